// K2: y[e, m, n] = wts[m, e] * (down_e[n] . h[e, m]) for expert e = blockIdx.y
// (E = gridDim.y experts). Block = 8 warps, each warp ROWS output rows of one
// expert; the experts' outputs are summed afterwards by MLX in a fixed order.
// Template ints: TOKENS, HIDDEN, INTER, BITS, GROUP (0 = one scale per row),
// ROWS, UNROLL.
// Inputs: h f32 [E, TOKENS, INTER], wts f32 [TOKENS, E], offs i64 [E, 8],
// the slot bytes. Output: y f32 [E, TOKENS, HIDDEN]. `slots` is
// declared by the generated prologue. Dynamic shared memory: TOKENS * INTER
// floats (this expert's h, see glm_stage).
constexpr int CPC = 128 / BITS;
constexpr int NCH = INTER / CPC;
constexpr int ROW_BYTES = INTER * BITS / 8;
constexpr int GPR = GROUP > 0 ? INTER / GROUP : 1;
constexpr int CPG = GROUP > 0 ? GROUP / CPC : 1;

extern __shared__ float4 glm_hs[];
const int e = blockIdx.y;
glm_stage<TOKENS, INTER, CPC>(h + static_cast<size_t>(e) * TOKENS * INTER, glm_hs);
__syncthreads();

const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int row0 = (blockIdx.x * (blockDim.x / 32) + warp) * ROWS;
if (row0 >= HIDDEN) {
  return;
}
const int64_t* off = offs + e * 8 + 1;
const uint8_t* dw = slots[offs[e * 8]] + off[4];
const float* ds = reinterpret_cast<const float*>(slots[offs[e * 8]] + off[5]);
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

for (int c0 = 0; c0 < NCH; c0 += 32 * UNROLL) {
  uint4 q[UNROLL][ROWS];
  float s[UNROLL][ROWS];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int ch = c0 + 32 * u + lane;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (ch < NCH) {
        q[u][r] = glm_load_chunk(dw + static_cast<size_t>(rows[r]) * ROW_BYTES + ch * 16);
        s[u][r] = GROUP > 0 ? __ldg(ds + rows[r] * GPR + ch / CPG) : 1.0f;
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
      float p[ROWS][TOKENS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int m = 0; m < TOKENS; ++m) {
          p[r][m] = 0.0f;
        }
      }
      glm_chunk_dots<BITS, TOKENS, NCH, ROWS>(q[u], glm_hs, ch, p);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
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
  const float rs = GROUP == 0 ? ds[rows[r]] : 1.0f;
#pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    const float v = glm_warp_sum(acc[r][m]);
    if (lane == 0 && row0 + r < HIDDEN) {
      y[(static_cast<size_t>(e) * TOKENS + m) * HIDDEN + row0 + r] = v * rs * wts[m * gridDim.y + e];
    }
  }
}
