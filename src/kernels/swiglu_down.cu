// K2: y[m, n] = sum_e wts[m, e] * (down_e[n] . h[e, m]).
// Block = 8 warps, each warp ROWS output rows; the experts are looped.
// Template ints: EXPERTS, TOKENS, HIDDEN, INTER, BITS, GROUP (0 = one scale per row), ROWS.
// Inputs: h f32 [EXPERTS, TOKENS, INTER], wts f32 [TOKENS, EXPERTS], offs i32 [EXPERTS, 6], e0.. slot bytes.
// Output: y f32 [TOKENS, HIDDEN]. `slots` is declared by the generated prologue.
// Dynamic shared memory: EXPERTS * TOKENS * CPC * (NCH + 1) floats.
constexpr int CPC = 128 / BITS;
constexpr int NCH = INTER / CPC;
constexpr int NCHP = NCH + 1;
constexpr int ROW_BYTES = INTER * BITS / 8;
constexpr int GPR = GROUP > 0 ? INTER / GROUP : 1;
constexpr int CPG = GROUP > 0 ? GROUP / CPC : 1;

extern __shared__ float glm_hs[];
for (int idx = threadIdx.x; idx < EXPERTS * TOKENS * INTER; idx += blockDim.x) {
  const int em = idx / INTER;
  const int col = idx - em * INTER;
  const int ch = col / CPC;
  const int j = col - ch * CPC;
  glm_hs[(em * CPC + j) * NCHP + ch] = h[idx];
}
__syncthreads();

const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int row0 = (blockIdx.x * (blockDim.x / 32) + warp) * ROWS;
if (row0 >= HIDDEN) {
  return;
}
int rows[ROWS];
#pragma unroll
for (int r = 0; r < ROWS; ++r) {
  rows[r] = min(row0 + r, HIDDEN - 1);
}
float acc[ROWS][TOKENS];
#pragma unroll
for (int r = 0; r < ROWS; ++r) {
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    acc[r][m] = 0.0f;
  }
}

#pragma unroll
for (int e = 0; e < EXPERTS; ++e) {
  const int* off = offs + e * 6;
  const uint8_t* dw = slots[e] + off[4];
  const float* ds = reinterpret_cast<const float*>(slots[e] + off[5]);
  float part[ROWS][TOKENS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int m = 0; m < TOKENS; ++m) {
      part[r][m] = 0.0f;
    }
  }
  for (int ch = lane; ch < NCH; ch += 32) {
    uint4 q[ROWS];
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      q[r] = __ldg(reinterpret_cast<const uint4*>(
          dw + static_cast<size_t>(rows[r]) * ROW_BYTES + ch * 16));
      if constexpr (GROUP > 0) {
        s[r] = __ldg(ds + rows[r] * GPR + ch / CPG);
      } else {
        s[r] = 1.0f;
      }
    }
#pragma unroll
    for (int m = 0; m < TOKENS; ++m) {
      float hv[CPC];
#pragma unroll
      for (int j = 0; j < CPC; ++j) {
        hv[j] = glm_hs[((e * TOKENS + m) * CPC + j) * NCHP + ch];
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        part[r][m] = fmaf(glm_chunk_dot<BITS>(q[r], hv), s[r], part[r][m]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float rs = GROUP == 0 ? ds[rows[r]] : 1.0f;
#pragma unroll
    for (int m = 0; m < TOKENS; ++m) {
      acc[r][m] = fmaf(part[r][m], rs * wts[m * EXPERTS + e], acc[r][m]);
    }
  }
}

#pragma unroll
for (int r = 0; r < ROWS; ++r) {
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    const float v = glm_warp_sum(acc[r][m]);
    if (lane == 0 && row0 + r < HIDDEN) {
      y[static_cast<size_t>(m) * HIDDEN + row0 + r] = v;
    }
  }
}
