// Helpers of the tensor-core (MMA) int4 expert kernels (glm-stream,
// src/kernels). Placed by MLX before `namespace mlx::core::cu`.
//
// One warp-wide `mma.m16n8k16` (bf16 in, f32 accumulate) multiplies 16
// weight rows by 16 columns. Each lane owns 32 consecutive columns of a
// 128-column chunk (lane % 4 = t: columns 32t .. 32t + 31, one 16-byte load
// per row) and feeds four of them to each of the chunk's 8 MMAs. The
// activations are split into x = hi + lo (two bf16, 16 significant bits
// together), and column n of B holds the hi (n even) or lo (n odd) part of
// lane t = n / 2's columns only, zero elsewhere: so D[row][2t] + D[row][2t+1]
// is exactly lane t's partial dot product, and lane t can apply the scale of
// its own group (groups are multiples of 32 columns). The tensor cores do
// the multiply-adds; the lanes only decode nibbles, two per `lop3` + `fma`.

// Two int4 weights as bf16x2, exactly: bits 0-3 and 16-19 of `w` are nibbles
// n_lo and n_hi; OR-ing them into the mantissa of bf16 128 gives 128 + n, and
// (128 + n) * 1 - 136 = n - 8 is exact in one rounding.
__device__ __forceinline__ unsigned int glm_nibble_pair(const unsigned int w) {
  const unsigned int v = (w & 0x000F000Fu) | 0x43004300u;
  unsigned int d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3F803F80u), "r"(0xC308C308u));
  return d;
}

// bf16 bits of f rounded to nearest even, and f - that bf16 rounded again:
// together they hold f to 2^-17 relative (and exactly for bf16 inputs).
__device__ __forceinline__ void glm_split_bf16(const float f, unsigned int& hi, unsigned int& lo) {
  unsigned short h, l;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  const float rest = f - __uint_as_float(static_cast<unsigned int>(h) << 16);
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(l) : "f"(rest));
  hi = h;
  lo = l;
}

// d += A(16 x 16, bf16) * B(16 x 8, bf16), f32 accumulators.
__device__ __forceinline__ void glm_mma(float (&d)[4], const unsigned int (&a)[4],
                                        const uint2 b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// A 16-byte chunk of weights, read once (read-only, not kept in L1).
__device__ __forceinline__ uint4 glm_mma_load(const uint8_t* p) {
  uint4 q;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
               : "l"(p));
  return q;
}

// Word k (0..3, a compile-time constant after unrolling) of a 16-byte chunk.
__device__ __forceinline__ unsigned int glm_mma_word(const uint4 q, const int k) {
  return k == 0 ? q.x : (k == 1 ? q.y : (k == 2 ? q.z : q.w));
}

// The B fragments of TOKENS rows of COLS values (f32, or bf16 when BF16;
// COLS a multiple of 32), in shared memory as uint2 [token][chunk][mma j]
// [hl][t]: the 4 bf16 (hi if hl = 0, else lo) lane t feeds MMA j of the
// chunk, in register order (b0, b1, b2, b3). MMA j takes word j / 2 of lane
// t's 32 columns and, within it, nibble pairs s = 2 (j % 2) (registers a0 /
// b0) and s + 1 (a1 / b1); a pair holds nibbles s (low half) and s + 4 (high
// half). So column 8 wd + n of lane t is register (n % 4) % 2, half n / 4 of
// MMA 2 wd + (n % 4) / 2. Columns past COLS (a partial last chunk) are zero.
// One thread converts one 8-column word.
template <int TOKENS, int COLS, bool BF16>
__device__ __forceinline__ void glm_stage_fragments(const void* src, uint2* dst) {
  constexpr int NCH = (COLS + 127) / 128;
  for (int idx = threadIdx.x; idx < TOKENS * NCH * 16; idx += blockDim.x) {
    const int m = idx / (NCH * 16);
    const int cw = idx % (NCH * 16);
    const int ch = cw / 16;
    const int t = (cw / 4) % 4;
    const int wd = cw % 4;
    const int c = ch * 128 + 32 * t + 8 * wd;
    const size_t at = static_cast<size_t>(m) * COLS + c;
    float v[8];
    if (c >= COLS) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        v[n] = 0.0f;
      }
    } else if (BF16) {
      // 8 bf16 = 16 bytes; a bf16 is the top half of its f32.
      const uint4 b = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(src) + at);
      const unsigned int w[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
      }
    } else {
      const float4* s4 = reinterpret_cast<const float4*>(static_cast<const float*>(src) + at);
      const float4 a = s4[0];
      const float4 b = s4[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
    unsigned int hi[8], lo[8];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      glm_split_bf16(v[n], hi[n], lo[n]);
    }
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      // Register r, half u of this MMA is nibble 2 jj + r + 4 u.
      const int n0 = 2 * jj;
      const int j = 2 * wd + jj;
      uint2* f = dst + ((static_cast<size_t>(m) * NCH + ch) * 8 + j) * 8;
      f[t] = make_uint2(hi[n0] | (hi[n0 + 4] << 16), hi[n0 + 1] | (hi[n0 + 5] << 16));
      f[4 + t] = make_uint2(lo[n0] | (lo[n0 + 4] << 16), lo[n0 + 1] | (lo[n0 + 5] << 16));
    }
  }
}

// f32 to bf16 bits, round to nearest even.
__device__ __forceinline__ unsigned short glm_to_bf16(const float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// Lane (g = lane / 4, t = lane % 4) holds B column g, which is lane g / 2's
// hi (g even) or lo (g odd) part: only lanes with g / 2 == t load, the rest
// feed zeros.
__device__ __forceinline__ uint2 glm_b_fragment(const uint2* frags, const bool active,
                                                const int slot) {
  return active ? frags[slot] : make_uint2(0u, 0u);
}

// Sum over the 4 lanes of a quad (lanes 4g .. 4g + 3).
__device__ __forceinline__ float glm_quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
