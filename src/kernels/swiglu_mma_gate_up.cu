// K1 (tensor cores, int4): h[e, m, i] = silu(gate_e[i] . x[m]) * (up_e[i] . x[m]).
// Block = 8 warps; warp w takes intermediate rows i0 .. i0 + 7 of expert
// blockIdx.y as the 16 MMA rows (0-7 gate, 8-15 up), so each lane ends with
// gate and up of one row. Lanes stream 16 bytes of each of their two rows per
// 128-column chunk, UNROLL chunks per step with the next step's loads issued
// before this step's math.
// Template ints: TOKENS, HIDDEN, INTER, GROUP (0 = one scale per row), UNROLL,
// XBF16 (x is bf16, else f32).
// Inputs: x [TOKENS, HIDDEN], offs i64 [E, 8] (per expert: which slot input
// holds it, then the byte offsets in that input of gate weight, gate scales,
// up weight, up scales, down weight, down scales; one pad), the slot inputs
// (`slots`, declared by the generated prologue: slot or arena bytes). Outputs: h f32
// [E, TOKENS, INTER]; cnt u32 [ceil(HIDDEN / 128)], zeroed here for K2's
// completion counters (a fresh buffer per call, ordered before K2 by the
// h dependency). Dynamic shared memory: TOKENS * HIDDEN * 4 bytes (rounded
// up to 128 columns: x's B fragments, see glm_stage_fragments).
constexpr int NCH = (HIDDEN + 127) / 128;
constexpr int ROW_BYTES = HIDDEN / 2;
constexpr int GPR = GROUP > 0 ? HIDDEN / GROUP : 1;

extern __shared__ uint2 glm_xf[];
const int expert = blockIdx.y;
const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int g = lane / 4;
const int t = lane % 4;
const int i0 = (blockIdx.x * (blockDim.x / 32) + warp) * 8;
const bool active = g / 2 == t;
const int bslot = (g % 2) * 4 + t;

const uint8_t* slot = slots[offs[expert * 8]];
const int64_t* off = offs + expert * 8 + 1;
const int row = min(i0 + g, INTER - 1);
const uint8_t* wg = slot + off[0] + static_cast<size_t>(row) * ROW_BYTES + 16 * t;
const uint8_t* wu = slot + off[2] + static_cast<size_t>(row) * ROW_BYTES + 16 * t;
const float* sg = reinterpret_cast<const float*>(slot + off[1]) + static_cast<size_t>(row) * GPR;
const float* su = reinterpret_cast<const float*>(slot + off[3]) + static_cast<size_t>(row) * GPR;

// Chunk ch of this lane: weights of both rows and their group scales.
uint4 qg[2][UNROLL], qu[2][UNROLL];
float cg[2][UNROLL], cu[2][UNROLL];
auto fetch = [&](const int buf, const int c0) {
  #pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int ch = c0 + u;
    const int col = ch * 128 + 32 * t;
    if (i0 < INTER && ch < NCH && col < HIDDEN) {
      qg[buf][u] = glm_mma_load(wg + ch * 64);
      qu[buf][u] = glm_mma_load(wu + ch * 64);
      cg[buf][u] = GROUP > 0 ? __ldg(sg + col / (GROUP > 0 ? GROUP : 1)) : 1.0f;
      cu[buf][u] = GROUP > 0 ? __ldg(su + col / (GROUP > 0 ? GROUP : 1)) : 1.0f;
    } else {
      qg[buf][u] = make_uint4(0u, 0u, 0u, 0u);
      qu[buf][u] = make_uint4(0u, 0u, 0u, 0u);
      cg[buf][u] = 0.0f;
      cu[buf][u] = 0.0f;
    }
  }
};

if (blockIdx.x == 0 && blockIdx.y == 0) {
  for (int i = threadIdx.x; i < (HIDDEN + 127) / 128; i += blockDim.x) {
    cnt[i] = 0u;
  }
}

// The first weights are in flight while x is staged.
fetch(0, 0);
glm_stage_fragments<TOKENS, HIDDEN, XBF16 != 0>(x, glm_xf);
__syncthreads();
if (i0 >= INTER) {
  return;
}

float accg[TOKENS], accu[TOKENS];
#pragma unroll
for (int m = 0; m < TOKENS; ++m) {
  accg[m] = 0.0f;
  accu[m] = 0.0f;
}

#pragma unroll 1
for (int c0 = 0; c0 < NCH; c0 += 2 * UNROLL) {
  #pragma unroll
  for (int buf = 0; buf < 2; ++buf) {
    const int cb = c0 + buf * UNROLL;
    if (cb >= NCH) {
      break;
    }
    fetch(1 - buf, cb + UNROLL);
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int ch = cb + u;
      if (ch < NCH) {
        float d[TOKENS][4];
        #pragma unroll
        for (int m = 0; m < TOKENS; ++m) {
          d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.0f;
        }
        #pragma unroll
        for (int wd = 0; wd < 4; ++wd) {
          const unsigned int a_g = glm_mma_word(qg[buf][u], wd);
          const unsigned int a_u = glm_mma_word(qu[buf][u], wd);
          #pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const unsigned int a[4] = {
                glm_nibble_pair(a_g >> (8 * jj)), glm_nibble_pair(a_u >> (8 * jj)),
                glm_nibble_pair(a_g >> (8 * jj + 4)), glm_nibble_pair(a_u >> (8 * jj + 4))};
            const int j = 2 * wd + jj;
            #pragma unroll
            for (int m = 0; m < TOKENS; ++m) {
              const uint2 b = glm_b_fragment(glm_xf + ((m * NCH + ch) * 8 + j) * 8, active, bslot);
              glm_mma(d[m], a, b);
            }
          }
        }
        #pragma unroll
        for (int m = 0; m < TOKENS; ++m) {
          accg[m] = fmaf(d[m][0] + d[m][1], cg[buf][u], accg[m]);
          accu[m] = fmaf(d[m][2] + d[m][3], cu[buf][u], accu[m]);
        }
      }
    }
  }
}

const float rg = GROUP == 0 ? sg[0] : 1.0f;
const float ru = GROUP == 0 ? su[0] : 1.0f;
#pragma unroll
for (int m = 0; m < TOKENS; ++m) {
  const float gv = glm_quad_sum(accg[m]) * rg;
  const float uv = glm_quad_sum(accu[m]) * ru;
  if (t == 0 && i0 + g < INTER) {
    h[(static_cast<size_t>(expert) * TOKENS + m) * INTER + i0 + g] = gv / (1.0f + expf(-gv)) * uv;
  }
}
