// Helpers of the fused SwiGLU expert kernels (glm-stream, src/kernels).
// Placed by MLX before `namespace mlx::core::cu`.

// Dot product of one 16-byte chunk of a quantized row with the matching
// input columns `xs` (already in registers): 32 int4 columns (low nibble =
// even column, value n - 8) or 16 int8 columns (two's complement).
// Each code becomes a float without an int->float conversion: OR-ing it into
// the mantissa of 2^23 gives 2^23 + code exactly, and subtracting
// 2^23 + zero point leaves the signed value exactly.
template <int BITS>
__device__ __forceinline__ float glm_chunk_dot(const uint4 q, const float* xs) {
  const unsigned int w[4] = {q.x, q.y, q.z, q.w};
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (BITS == 4) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float v =
            __int_as_float(0x4B000000u | ((w[k] >> (4 * n)) & 0xFu)) - 8388616.0f;
        s = fmaf(v, xs[k * 8 + n], s);
      }
    } else {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float v =
            __int_as_float(0x4B000000u | (((w[k] >> (8 * n)) & 0xFFu) ^ 0x80u)) -
            8388736.0f;
        s = fmaf(v, xs[k * 4 + n], s);
      }
    }
  }
  return s;
}

// Sum over the 32 lanes of a warp (every lane gets the total).
__device__ __forceinline__ float glm_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}
