// K2 (Metal twin of swiglu_down.cu; UNTESTED: no Mac here).
// y[m, n] = sum_e wts[m, e] * (down_e[n] . h[e, m]).
// Threadgroup = 8 simdgroups, each ROWS output rows; the experts are looped.
// Template ints: EXPERTS, TOKENS, HIDDEN, INTER, BITS, GROUP, ROWS,
// SMEM_FLOATS (EXPERTS * TOKENS * CPC * (NCH + 1), at most 8192 = 32 KB).
constexpr int CPC = 128 / BITS;
constexpr int NCH = INTER / CPC;
constexpr int NCHP = NCH + 1;
constexpr int ROW_BYTES = INTER * BITS / 8;
constexpr int GPR = GROUP > 0 ? INTER / GROUP : 1;
constexpr int CPG = GROUP > 0 ? GROUP / CPC : 1;

threadgroup float glm_hs[SMEM_FLOATS];
for (int idx = thread_index_in_threadgroup; idx < EXPERTS * TOKENS * INTER;
     idx += threads_per_threadgroup.x) {
  const int em = idx / INTER;
  const int col = idx - em * INTER;
  const int ch = col / CPC;
  const int j = col - ch * CPC;
  glm_hs[(em * CPC + j) * NCHP + ch] = h[idx];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

const int warp = simdgroup_index_in_threadgroup;
const int lane = thread_index_in_simdgroup;
const int row0 = (threadgroup_position_in_grid.x * (threads_per_threadgroup.x / 32) + warp) * ROWS;
if (row0 >= HIDDEN) {
  return;
}
int rows[ROWS];
for (int r = 0; r < ROWS; ++r) {
  rows[r] = min(row0 + r, HIDDEN - 1);
}
float acc[ROWS][TOKENS];
for (int r = 0; r < ROWS; ++r) {
  for (int m = 0; m < TOKENS; ++m) {
    acc[r][m] = 0.0f;
  }
}

for (int e = 0; e < EXPERTS; ++e) {
  device const int64_t* off = offs + e * 8 + 1;
  device const uint8_t* dw = slots[offs[e * 8]] + off[4];
  device const float* ds = (device const float*)(slots[offs[e * 8]] + off[5]);
  float part[ROWS][TOKENS];
  for (int r = 0; r < ROWS; ++r) {
    for (int m = 0; m < TOKENS; ++m) {
      part[r][m] = 0.0f;
    }
  }
  for (int ch = lane; ch < NCH; ch += 32) {
    uint4 q[ROWS];
    float s[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      q[r] = *((device const uint4*)(dw + size_t(rows[r]) * ROW_BYTES + ch * 16));
      if (GROUP > 0) {
        s[r] = ds[rows[r] * GPR + ch / CPG];
      } else {
        s[r] = 1.0f;
      }
    }
    for (int m = 0; m < TOKENS; ++m) {
      float hv[CPC];
      for (int j = 0; j < CPC; ++j) {
        hv[j] = glm_hs[((e * TOKENS + m) * CPC + j) * NCHP + ch];
      }
      for (int r = 0; r < ROWS; ++r) {
        part[r][m] = fma(glm_chunk_dot<BITS>(q[r], hv), s[r], part[r][m]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const float rs = GROUP == 0 ? ds[rows[r]] : 1.0f;
    for (int m = 0; m < TOKENS; ++m) {
      acc[r][m] = fma(part[r][m], rs * wts[m * EXPERTS + e], acc[r][m]);
    }
  }
}

for (int r = 0; r < ROWS; ++r) {
  for (int m = 0; m < TOKENS; ++m) {
    const float v = glm_warp_sum(acc[r][m]);
    if (lane == 0 && row0 + r < HIDDEN) {
      y[size_t(m) * HIDDEN + row0 + r] = v;
    }
  }
}
