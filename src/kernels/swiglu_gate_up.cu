// K1: h[e, m, i] = silu(gate_e[i] . x[m]) * (up_e[i] . x[m]).
// Block = 8 warps, each warp ROWS intermediate rows of expert blockIdx.y;
// each lane takes UNROLL chunks (16 bytes of each of the 2 * ROWS rows) per
// step, so 2 * ROWS * UNROLL loads are in flight before any arithmetic.
// Template ints: TOKENS, HIDDEN, INTER, BITS, GROUP (0 = one scale per row),
// ROWS, UNROLL.
// Inputs: x f32 [TOKENS, HIDDEN], offs i64 [E, 8] (per expert: its slot
// input, then the byte offsets in it of gate weight, gate scales, up weight,
// up scales, down weight, down scales; one pad), the slot inputs. Output: h f32 [E, TOKENS, INTER]. `slots` is
// declared by the generated prologue. Dynamic shared memory: TOKENS * HIDDEN
// floats (x, see glm_stage).
constexpr int CPC = 128 / BITS;  // columns per 16-byte chunk
constexpr int NCH = HIDDEN / CPC;
constexpr int ROW_BYTES = HIDDEN * BITS / 8;
constexpr int GPR = GROUP > 0 ? HIDDEN / GROUP : 1;  // scales per row
constexpr int CPG = GROUP > 0 ? GROUP / CPC : 1;     // chunks per scale group
constexpr int NR = 2 * ROWS;                         // gate rows, then up rows

extern __shared__ float4 glm_xs[];
const int expert = blockIdx.y;
const uint8_t* slot = slots[offs[expert * 8]];
glm_stage<TOKENS, HIDDEN, CPC>(x, glm_xs);
__syncthreads();

const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int row0 = (blockIdx.x * (blockDim.x / 32) + warp) * ROWS;
if (row0 >= INTER) {
  return;
}
const int64_t* off = offs + expert * 8 + 1;
const uint8_t* wbase[2] = {slot + off[0], slot + off[2]};
const float* sbase[2] = {reinterpret_cast<const float*>(slot + off[1]),
                         reinterpret_cast<const float*>(slot + off[3])};

int rows[ROWS];
#pragma unroll
for (int r = 0; r < ROWS; ++r) {
  rows[r] = min(row0 + r, INTER - 1);
}
float acc[NR][TOKENS];
#pragma unroll
for (int r = 0; r < NR; ++r) {
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    acc[r][m] = 0.0f;
  }
}

for (int c0 = 0; c0 < NCH; c0 += 32 * UNROLL) {
  uint4 q[UNROLL][NR];
  float s[UNROLL][NR];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int ch = c0 + 32 * u + lane;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int row = rows[r % ROWS];
      if (ch < NCH) {
        q[u][r] = glm_load_chunk(wbase[r / ROWS] + static_cast<size_t>(row) * ROW_BYTES + ch * 16);
        s[u][r] = GROUP > 0 ? __ldg(sbase[r / ROWS] + row * GPR + ch / CPG) : 1.0f;
      } else {
        q[u][r] = make_uint4(0u, 0u, 0u, 0u);
        s[u][r] = 0.0f;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int ch = c0 + 32 * u + lane;
    if (ch < NCH) {
      float p[NR][TOKENS];
#pragma unroll
      for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int m = 0; m < TOKENS; ++m) {
          p[r][m] = 0.0f;
        }
      }
      glm_chunk_dots<BITS, TOKENS, NCH, NR>(q[u], glm_xs, ch, p);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int m = 0; m < TOKENS; ++m) {
          acc[r][m] = fmaf(p[r][m], s[u][r], acc[r][m]);
        }
      }
    }
  }
}

#pragma unroll
for (int r = 0; r < ROWS; ++r) {
  const float rg = GROUP == 0 ? sbase[0][rows[r]] : 1.0f;
  const float ru = GROUP == 0 ? sbase[1][rows[r]] : 1.0f;
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    const float g = glm_warp_sum(acc[r][m]) * rg;
    const float u = glm_warp_sum(acc[ROWS + r][m]) * ru;
    if (lane == 0 && row0 + r < INTER) {
      h[(static_cast<size_t>(expert) * TOKENS + m) * INTER + row0 + r] = g / (1.0f + expf(-g)) * u;
    }
  }
}
