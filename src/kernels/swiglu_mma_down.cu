// K2 (tensor cores, int4): y[m, n] = sum over e = 0 .. E-1, in that order, of
// wts[m, e] * (down_e[n] . h[e, m]).
// Block = 8 warps; warp w takes output rows r0 .. r0 + 15 of expert
// blockIdx.y (MMA rows g and g + 8 of lane g, t) and writes them to
// part[e]. The block that finishes a row range last (a completion counter
// per blockIdx.x, threadfence-reduction style) sums the E parts in expert
// order and writes y, so results do not depend on scheduling.
// Template ints: TOKENS, HIDDEN, INTER, GROUP (0 = one scale per row), UNROLL,
// YBF16 (y is bf16, else f32).
// Inputs: h f32 [E, TOKENS, INTER], wts f32 [TOKENS, E], offs i64 [E, 8],
// cnt u32 [gridDim.x] (zeroed by K1), the slot bytes (`slots`). Outputs: y
// [TOKENS, HIDDEN]; part f32 [E, TOKENS, HIDDEN] (scratch). Dynamic shared
// memory: TOKENS * INTER * 4 bytes (rounded up to 128 columns: this expert's
// h as B fragments).
constexpr int NCH = (INTER + 127) / 128;
constexpr int ROW_BYTES = INTER / 2;
constexpr int GPR = GROUP > 0 ? INTER / GROUP : 1;

extern __shared__ uint2 glm_hf[];
const int e = blockIdx.y;
const int experts = gridDim.y;
const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int g = lane / 4;
const int t = lane % 4;
const int r0 = (blockIdx.x * (blockDim.x / 32) + warp) * 16;
const bool active = g / 2 == t;
const int bslot = (g % 2) * 4 + t;

const uint8_t* slot = slots[offs[e * 8]];
const int64_t* off = offs + e * 8 + 1;
const int row_a = min(r0 + g, HIDDEN - 1);
const int row_b = min(r0 + g + 8, HIDDEN - 1);
const uint8_t* wa = slot + off[4] + static_cast<size_t>(row_a) * ROW_BYTES + 16 * t;
const uint8_t* wb = slot + off[4] + static_cast<size_t>(row_b) * ROW_BYTES + 16 * t;
const float* sa = reinterpret_cast<const float*>(slot + off[5]) + static_cast<size_t>(row_a) * GPR;
const float* sb = reinterpret_cast<const float*>(slot + off[5]) + static_cast<size_t>(row_b) * GPR;

uint4 qa[2][UNROLL], qb[2][UNROLL];
float ca[2][UNROLL], cb_[2][UNROLL];
auto fetch = [&](const int buf, const int c0) {
  #pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int ch = c0 + u;
    const int col = ch * 128 + 32 * t;
    if (r0 < HIDDEN && ch < NCH && col < INTER) {
      qa[buf][u] = glm_mma_load(wa + ch * 64);
      qb[buf][u] = glm_mma_load(wb + ch * 64);
      ca[buf][u] = GROUP > 0 ? __ldg(sa + col / (GROUP > 0 ? GROUP : 1)) : 1.0f;
      cb_[buf][u] = GROUP > 0 ? __ldg(sb + col / (GROUP > 0 ? GROUP : 1)) : 1.0f;
    } else {
      qa[buf][u] = make_uint4(0u, 0u, 0u, 0u);
      qb[buf][u] = make_uint4(0u, 0u, 0u, 0u);
      ca[buf][u] = 0.0f;
      cb_[buf][u] = 0.0f;
    }
  }
};

fetch(0, 0);
glm_stage_fragments<TOKENS, INTER, false>(h + static_cast<size_t>(e) * TOKENS * INTER, glm_hf);
__syncthreads();
// Warp-uniform: warps past HIDDEN skip to the completion step.
if (r0 < HIDDEN) {
  float acca[TOKENS], accb[TOKENS];
  #pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    acca[m] = 0.0f;
    accb[m] = 0.0f;
  }

  #pragma unroll 1
  for (int c0 = 0; c0 < NCH; c0 += 2 * UNROLL) {
    #pragma unroll
    for (int buf = 0; buf < 2; ++buf) {
      const int cbase = c0 + buf * UNROLL;
      if (cbase >= NCH) {
        break;
      }
      fetch(1 - buf, cbase + UNROLL);
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int ch = cbase + u;
        if (ch < NCH) {
          float d[TOKENS][4];
          #pragma unroll
          for (int m = 0; m < TOKENS; ++m) {
            d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.0f;
          }
          #pragma unroll
          for (int wd = 0; wd < 4; ++wd) {
            const unsigned int w_a = glm_mma_word(qa[buf][u], wd);
            const unsigned int w_b = glm_mma_word(qb[buf][u], wd);
            #pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              const unsigned int a[4] = {
                  glm_nibble_pair(w_a >> (8 * jj)), glm_nibble_pair(w_b >> (8 * jj)),
                  glm_nibble_pair(w_a >> (8 * jj + 4)), glm_nibble_pair(w_b >> (8 * jj + 4))};
              const int j = 2 * wd + jj;
              #pragma unroll
              for (int m = 0; m < TOKENS; ++m) {
                const uint2 b = glm_b_fragment(glm_hf + ((m * NCH + ch) * 8 + j) * 8, active, bslot);
                glm_mma(d[m], a, b);
              }
            }
          }
          #pragma unroll
          for (int m = 0; m < TOKENS; ++m) {
            acca[m] = fmaf(d[m][0] + d[m][1], ca[buf][u], acca[m]);
            accb[m] = fmaf(d[m][2] + d[m][3], cb_[buf][u], accb[m]);
          }
        }
      }
    }
  }

  const float rsa = GROUP == 0 ? sa[0] : 1.0f;
  const float rsb = GROUP == 0 ? sb[0] : 1.0f;
  #pragma unroll
  for (int m = 0; m < TOKENS; ++m) {
    const float va = glm_quad_sum(acca[m]) * rsa;
    const float vb = glm_quad_sum(accb[m]) * rsb;
    const float w = wts[m * experts + e];
    float* out = part + (static_cast<size_t>(e) * TOKENS + m) * HIDDEN;
    if (t == 0 && r0 + g < HIDDEN) {
      out[r0 + g] = va * w;
    }
    if (t == 0 && r0 + g + 8 < HIDDEN) {
      out[r0 + g + 8] = vb * w;
    }
  }
}

// Completion: publish this block's part, count it; the last of the E blocks
// of this row range reads every part (from L2: __ldcg) and writes y.
__shared__ bool glm_last;
__threadfence();
__syncthreads();
if (threadIdx.x == 0) {
  glm_last = atomicAdd(const_cast<unsigned int*>(cnt) + blockIdx.x, 1u) ==
      static_cast<unsigned int>(experts - 1);
}
__syncthreads();
if (glm_last) {
  __threadfence();
  const int rows_per_block = 16 * (blockDim.x / 32);
  for (int idx = threadIdx.x; idx < TOKENS * rows_per_block; idx += blockDim.x) {
    const int m = idx / rows_per_block;
    const int r = blockIdx.x * rows_per_block + idx % rows_per_block;
    if (r < HIDDEN) {
      float sum = 0.0f;
      for (int k = 0; k < experts; ++k) {
        sum += __ldcg(part + (static_cast<size_t>(k) * TOKENS + m) * HIDDEN + r);
      }
      const size_t at = static_cast<size_t>(m) * HIDDEN + r;
      if (YBF16) {
        reinterpret_cast<unsigned short*>(y)[at] = glm_to_bf16(sum);
      } else {
        reinterpret_cast<float*>(y)[at] = sum;
      }
    }
  }
}
