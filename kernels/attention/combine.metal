// Merges the partitions of a split decode attention (decode_attention.metal with LATHE_SPLIT): with
// M = max over partitions of their max m_p, partition p weighs w_p = l_p * exp(m_p - M) (its
// softmax sum at the common max), and out = sum_p w_p o_p / sum_p w_p. Empty partitions (past a
// shorter sequence's end: m = -inf, l = 0) weigh nothing.
// A threadgroup a row (query head hq of sequence b), a thread an output dimension d. The launch
// is a chain of L2 round trips, so it makes as few as it can: each thread issues the loads of
// its partials (64 partitions at a time) first, since they do not depend on the weights; every
// SIMD group meanwhile finds M and sum_p w_p with its lanes over the partitions; the first SIMD
// group writes the block's normalized weights into threadgroup memory, and the sums follow. For
// at most 64 partitions that is one round trip (a walk over the partitions one at a time, the
// first form, took 5.6 us for 34 of them in the decode loop: kernels/attention/NOTES.md).
// Thread (d, hq, b), threadgroup (D, 1, 1). Constants: D. Inputs: part_out[B, Hq, P, D],
// part_ml[B, Hq, P, 2], dims (int32: Hq, P). Output: out[B, Hq, D] (half).
constexpr uint PB = 64;  // partitions weighed at a time (kernels.attention.COMBINE_PARTS)
threadgroup float w_s[PB];
const uint d = thread_position_in_grid.x;
const uint hq = thread_position_in_grid.y;
const uint b = thread_position_in_grid.z;
const uint lane = thread_index_in_simdgroup;
const uint n_heads = uint(dims[0]);
const uint parts = uint(dims[1]);
const bool here = d < uint(D) && hq < n_heads;  // every thread reaches the barriers
const uint row = b * n_heads + (here ? hq : 0);
const float NEG_INF = -as_type<float>(0x7f800000u);
// This thread's partials of partitions p0 .. p0 + 63 (zero past the last).
float o[PB];
#define LOAD_PARTIALS(p0)                                                                        \
  LATHE_UNROLL                                                                                   \
  for (uint j = 0; j < PB; ++j) {                                                                \
    o[j] = here && (p0) + j < parts ? part_out[(row * parts + (p0) + j) * uint(D) + d] : 0.0f;   \
  }
LOAD_PARTIALS(0);
// Each lane's partitions (lane, lane + 32, ...) merged online into (mx, its sum at mx), then the
// SIMD group's: M and the denominator.
float mx = NEG_INF, sm = 0.0f;
for (uint p0 = 0; p0 < parts; p0 += PB) {
  float m2[2], l2[2];
  for (uint j = 0; j < 2; ++j) {
    const uint p = p0 + lane + 32 * j;
    m2[j] = p < parts ? part_ml[2 * (row * parts + p)] : NEG_INF;
    l2[j] = p < parts ? part_ml[2 * (row * parts + p) + 1] : 0.0f;
  }
  for (uint j = 0; j < 2; ++j) {
    if (l2[j] > 0.0f) {
      const float m_new = max(mx, m2[j]);
      sm = sm * exp(mx - m_new) + l2[j] * exp(m2[j] - m_new);
      mx = m_new;
    }
  }
}
const float m_all = simd_max(mx);
const float den = simd_sum(sm > 0.0f ? sm * exp(mx - m_all) : 0.0f);
float num = 0.0f;
for (uint p0 = 0; p0 < parts; p0 += PB) {
  if (p0 > 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the last block's weights are read
    LOAD_PARTIALS(p0);
  }
  if (thread_index_in_threadgroup < 32) {  // the block's weights (its m and l are in the L1 now)
    for (uint j = 0; j < 2; ++j) {
      const uint p = p0 + lane + 32 * j;
      const float m = p < parts ? part_ml[2 * (row * parts + p)] : NEG_INF;
      const float l = p < parts ? part_ml[2 * (row * parts + p) + 1] : 0.0f;
      w_s[lane + 32 * j] = l > 0.0f && den > 0.0f ? l * exp(m - m_all) / den : 0.0f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  LATHE_UNROLL
  for (uint j = 0; j < PB; ++j) num = w_s[j] > 0.0f ? fma(w_s[j], o[j], num) : num;  // NaN-safe
}
#undef LOAD_PARTIALS
if (here) out[row * uint(D) + d] = half(num);
