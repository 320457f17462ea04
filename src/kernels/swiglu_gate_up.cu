// K1: h[e, m, i] = silu(gate_e[i] . x[m]) * (up_e[i] . x[m]).
// Block = 8 warps, each warp ROWS intermediate rows of expert blockIdx.y.
// Template ints: EXPERTS, TOKENS, HIDDEN, INTER, BITS, GROUP (0 = one scale per row), ROWS.
// Inputs: x f32 [TOKENS, HIDDEN], offs i32 [EXPERTS, 6] (slot byte offsets of gate weight,
// gate scales, up weight, up scales, down weight, down scales), e0.. slot
// bytes. Output: h f32 [EXPERTS, TOKENS, INTER]. `slots` is declared by the generated
// prologue. Dynamic shared memory: TOKENS * CPC * (NCH + 1) floats.
constexpr int CPC = 128 / BITS;       // columns per 16-byte chunk
constexpr int NCH = HIDDEN / CPC;          // chunks per row
constexpr int NCHP = NCH + 1;         // padded (no bank conflicts when staging)
constexpr int ROW_BYTES = HIDDEN * BITS / 8;
constexpr int GPR = GROUP > 0 ? HIDDEN / GROUP : 1;   // scales per row
constexpr int CPG = GROUP > 0 ? GROUP / CPC : 1; // chunks per scale group

extern __shared__ float glm_xs[];
const int expert = blockIdx.y;
const uint8_t* slot = slots[expert];

// Stage x transposed per chunk: glm_xs[(m * CPC + j) * NCHP + ch] holds
// x[m, ch * CPC + j], so the lanes of a warp (consecutive ch) read
// consecutive words.
for (int idx = threadIdx.x; idx < TOKENS * HIDDEN; idx += blockDim.x) {
  const int m = idx / HIDDEN;
  const int col = idx - m * HIDDEN;
  const int ch = col / CPC;
  const int j = col - ch * CPC;
  glm_xs[(m * CPC + j) * NCHP + ch] = x[idx];
}
__syncthreads();

const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int row0 = (blockIdx.x * (blockDim.x / 32) + warp) * ROWS;
if (row0 >= INTER) {
  return;
}
const int* off = offs + expert * 6;
const uint8_t* gw = slot + off[0];
const float* gs = reinterpret_cast<const float*>(slot + off[1]);
const uint8_t* uw = slot + off[2];
const float* us = reinterpret_cast<const float*>(slot + off[3]);

int rows[ROWS];
#pragma unroll
for (int r = 0; r < ROWS; ++r) {
  rows[r] = min(row0 + r, INTER - 1);
}
float ag[ROWS][TOKENS];
float au[ROWS][TOKENS];
#pragma unroll
for (int r = 0; r < ROWS; ++r) {
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    ag[r][m] = 0.0f;
    au[r][m] = 0.0f;
  }
}

for (int ch = lane; ch < NCH; ch += 32) {
  uint4 qg[ROWS];
  uint4 qu[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const size_t base = static_cast<size_t>(rows[r]) * ROW_BYTES + ch * 16;
    qg[r] = __ldg(reinterpret_cast<const uint4*>(gw + base));
    qu[r] = __ldg(reinterpret_cast<const uint4*>(uw + base));
  }
  float sg[ROWS];
  float su[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if constexpr (GROUP > 0) {
      sg[r] = __ldg(gs + rows[r] * GPR + ch / CPG);
      su[r] = __ldg(us + rows[r] * GPR + ch / CPG);
    } else {
      sg[r] = 1.0f;
      su[r] = 1.0f;
    }
  }
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    float xv[CPC];
#pragma unroll
    for (int j = 0; j < CPC; ++j) {
      xv[j] = glm_xs[(m * CPC + j) * NCHP + ch];
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      ag[r][m] = fmaf(glm_chunk_dot<BITS>(qg[r], xv), sg[r], ag[r][m]);
      au[r][m] = fmaf(glm_chunk_dot<BITS>(qu[r], xv), su[r], au[r][m]);
    }
  }
}

#pragma unroll
for (int r = 0; r < ROWS; ++r) {
  float rg = 1.0f;
  float ru = 1.0f;
  if constexpr (GROUP == 0) {
    rg = gs[rows[r]];
    ru = us[rows[r]];
  }
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    const float g = glm_warp_sum(ag[r][m]) * rg;
    const float u = glm_warp_sum(au[r][m]) * ru;
    if (lane == 0 && row0 + r < INTER) {
      h[(static_cast<size_t>(expert) * TOKENS + m) * INTER + row0 + r] = g / (1.0f + expf(-g)) * u;
    }
  }
}
