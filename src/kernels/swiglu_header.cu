// Helpers of the fused SwiGLU expert kernels (glm-stream, src/kernels).
// Placed by MLX before `namespace mlx::core::cu`.

// Decodes one 32-bit word of a quantized row into floats: 8 int4 columns
// (low nibble = first column, value n - 8) or 4 int8 columns (two's
// complement). Each code becomes a float without an int->float conversion:
// OR-ing it into the mantissa of 2^23 gives 2^23 + code exactly, and
// subtracting 2^23 + zero point leaves the signed value exactly.
template <int BITS>
__device__ __forceinline__ void glm_decode_word(const unsigned int w, float* v) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      v[n] = __int_as_float(0x4B000000u | ((w >> (4 * n)) & 0xFu)) - 8388616.0f;
    }
  } else {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      v[n] = __int_as_float(0x4B000000u | (((w >> (8 * n)) & 0xFFu) ^ 0x80u)) -
          8388736.0f;
    }
  }
}

// Word k (0..3, a compile-time constant after unrolling) of a 16-byte chunk.
__device__ __forceinline__ unsigned int glm_word(const uint4 q, const int k) {
  return k == 0 ? q.x : (k == 1 ? q.y : (k == 2 ? q.z : q.w));
}

// A 16-byte chunk of weights, read once (read-only, not kept in L1).
__device__ __forceinline__ uint4 glm_load_chunk(const uint8_t* p) {
  uint4 q;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
               : "l"(p));
  return q;
}

// Sum over the 32 lanes of a warp (every lane gets the total).
__device__ __forceinline__ float glm_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// Stages TOKENS rows of COLS floats (`src`, row-major) in shared memory as
// float4s ordered [token][word k][float4 v of the word][chunk], so that the
// lanes of a warp (consecutive chunks) read consecutive float4s.
template <int TOKENS, int COLS, int CPC>
__device__ __forceinline__ void glm_stage(const float* src, float4* dst) {
  constexpr int NCH = COLS / CPC;
  constexpr int W4 = CPC / 16;  // float4s per word
  constexpr int F4 = COLS / 4;
  const float4* s4 = reinterpret_cast<const float4*>(src);
  for (int idx = threadIdx.x; idx < TOKENS * F4; idx += blockDim.x) {
    const int ch = idx % NCH;
    const int rest = idx / NCH;
    const int v = rest % W4;
    const int mk = rest / W4;
    const int k = mk % 4;
    const int m = mk / 4;
    dst[idx] = s4[m * F4 + (ch * CPC + k * (CPC / 4)) / 4 + v];
  }
}

// Accumulates, for NR quantized rows whose chunk `ch` is in q[0..NR), the
// dot products with the TOKENS staged rows: p[r][m] += chunk_r . x_m.
// Every weight is decoded once; every staged word is read once per chunk.
template <int BITS, int TOKENS, int NCH, int NR>
__device__ __forceinline__ void glm_chunk_dots(
    const uint4* q, const float4* xs, const int ch, float (*p)[TOKENS]) {
  constexpr int CPW = 32 / BITS;  // columns per word
  constexpr int W4 = CPW / 4;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float xw[TOKENS][CPW];
#pragma unroll
    for (int m = 0; m < TOKENS; ++m) {
#pragma unroll
      for (int v = 0; v < W4; ++v) {
        const float4 t = xs[((m * 4 + k) * W4 + v) * NCH + ch];
        xw[m][4 * v + 0] = t.x;
        xw[m][4 * v + 1] = t.y;
        xw[m][4 * v + 2] = t.z;
        xw[m][4 * v + 3] = t.w;
      }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float wv[CPW];
      glm_decode_word<BITS>(glm_word(q[r], k), wv);
#pragma unroll
      for (int m = 0; m < TOKENS; ++m) {
#pragma unroll
        for (int j = 0; j < CPW; ++j) {
          p[r][m] = fmaf(wv[j], xw[m][j], p[r][m]);
        }
      }
    }
  }
}
