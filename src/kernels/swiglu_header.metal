// Helpers of the fused SwiGLU expert kernels, Metal twin of
// swiglu_header.cu (glm-stream, src/kernels). UNTESTED: no Mac here.

// Dot product of one 16-byte chunk of a quantized row with the matching
// input columns `xs`: 32 int4 columns (low nibble = even column, value
// n - 8) or 16 int8 columns. OR-ing a code into the mantissa of 2^23 gives
// 2^23 + code exactly; subtracting 2^23 + zero point leaves the value.
template <int BITS>
inline float glm_chunk_dot(const uint4 q, thread const float* xs) {
  const uint w[4] = {q.x, q.y, q.z, q.w};
  float s = 0.0f;
  for (int k = 0; k < 4; ++k) {
    if (BITS == 4) {
      for (int n = 0; n < 8; ++n) {
        const float v =
            as_type<float>(0x4B000000u | ((w[k] >> (4 * n)) & 0xFu)) - 8388616.0f;
        s = fma(v, xs[k * 8 + n], s);
      }
    } else {
      for (int n = 0; n < 4; ++n) {
        const float v =
            as_type<float>(0x4B000000u | (((w[k] >> (8 * n)) & 0xFFu) ^ 0x80u)) -
            8388736.0f;
        s = fma(v, xs[k * 4 + n], s);
      }
    }
  }
  return s;
}

// Sum over the 32 lanes of a simdgroup.
inline float glm_warp_sum(float v) {
  return simd_sum(v);
}
