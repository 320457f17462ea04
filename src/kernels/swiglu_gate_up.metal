// K1 (Metal twin of swiglu_gate_up.cu; UNTESTED: no Mac here).
// h[e, m, i] = silu(gate_e[i] . x[m]) * (up_e[i] . x[m]).
// Threadgroup = 8 simdgroups, each ROWS intermediate rows of expert
// threadgroup_position_in_grid.y. Template ints: EXPERTS, TOKENS, HIDDEN,
// INTER, BITS, GROUP (0 = one scale per row), ROWS, SMEM_FLOATS (threadgroup
// floats: TOKENS * CPC * (NCH + 1), at most 8192 = 32 KB).
constexpr int CPC = 128 / BITS;
constexpr int NCH = HIDDEN / CPC;
constexpr int NCHP = NCH + 1;
constexpr int ROW_BYTES = HIDDEN * BITS / 8;
constexpr int GPR = GROUP > 0 ? HIDDEN / GROUP : 1;
constexpr int CPG = GROUP > 0 ? GROUP / CPC : 1;

threadgroup float glm_xs[SMEM_FLOATS];
const int expert = threadgroup_position_in_grid.y;
device const uint8_t* slot = slots[offs[expert * 8]];

for (int idx = thread_index_in_threadgroup; idx < TOKENS * HIDDEN;
     idx += threads_per_threadgroup.x) {
  const int m = idx / HIDDEN;
  const int col = idx - m * HIDDEN;
  const int ch = col / CPC;
  const int j = col - ch * CPC;
  glm_xs[(m * CPC + j) * NCHP + ch] = x[idx];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

const int warp = simdgroup_index_in_threadgroup;
const int lane = thread_index_in_simdgroup;
const int row0 = (threadgroup_position_in_grid.x * (threads_per_threadgroup.x / 32) + warp) * ROWS;
if (row0 >= INTER) {
  return;
}
device const int64_t* off = offs + expert * 8 + 1;
device const uint8_t* gw = slot + off[0];
device const float* gs = (device const float*)(slot + off[1]);
device const uint8_t* uw = slot + off[2];
device const float* us = (device const float*)(slot + off[3]);

int rows[ROWS];
for (int r = 0; r < ROWS; ++r) {
  rows[r] = min(row0 + r, INTER - 1);
}
float ag[ROWS][TOKENS];
float au[ROWS][TOKENS];
for (int r = 0; r < ROWS; ++r) {
  for (int m = 0; m < TOKENS; ++m) {
    ag[r][m] = 0.0f;
    au[r][m] = 0.0f;
  }
}

for (int ch = lane; ch < NCH; ch += 32) {
  uint4 qg[ROWS];
  uint4 qu[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const size_t base = size_t(rows[r]) * ROW_BYTES + ch * 16;
    qg[r] = *((device const uint4*)(gw + base));
    qu[r] = *((device const uint4*)(uw + base));
  }
  float sg[ROWS];
  float su[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    if (GROUP > 0) {
      sg[r] = gs[rows[r] * GPR + ch / CPG];
      su[r] = us[rows[r] * GPR + ch / CPG];
    } else {
      sg[r] = 1.0f;
      su[r] = 1.0f;
    }
  }
  for (int m = 0; m < TOKENS; ++m) {
    float xv[CPC];
    for (int j = 0; j < CPC; ++j) {
      xv[j] = glm_xs[(m * CPC + j) * NCHP + ch];
    }
    for (int r = 0; r < ROWS; ++r) {
      ag[r][m] = fma(glm_chunk_dot<BITS>(qg[r], xv), sg[r], ag[r][m]);
      au[r][m] = fma(glm_chunk_dot<BITS>(qu[r], xv), su[r], au[r][m]);
    }
  }
}

for (int r = 0; r < ROWS; ++r) {
  float rg = 1.0f;
  float ru = 1.0f;
  if (GROUP == 0) {
    rg = gs[rows[r]];
    ru = us[rows[r]];
  }
  for (int m = 0; m < TOKENS; ++m) {
    const float g = glm_warp_sum(ag[r][m]) * rg;
    const float u = glm_warp_sum(au[r][m]) * ru;
    if (lane == 0 && row0 + r < INTER) {
      h[(size_t(expert) * TOKENS + m) * INTER + row0 + r] = g / (1.0f + metal::precise::exp(-g)) * u;
    }
  }
}
