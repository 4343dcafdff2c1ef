// Merges the partitions of a split decode attention (decode_attention.metal with LATHE_SPLIT): with
// M = max over partitions of their max m_p, partition p weighs w_p = l_p * exp(m_p - M) (its
// softmax sum at the common max), and out = sum_p w_p o_p / sum_p w_p. Empty partitions (past a
// shorter sequence's end: m = -inf, l = 0) weigh nothing.
// Thread (d, hq, b). Constants: D. Inputs: part_out[B, Hq, P, D], part_ml[B, Hq, P, 2],
// dims (int32: Hq, P). Output: out[B, Hq, D] (half).
const uint d = thread_position_in_grid.x;
const uint hq = thread_position_in_grid.y;
const uint b = thread_position_in_grid.z;
const uint n_heads = uint(dims[0]);
const uint parts = uint(dims[1]);
if (d >= uint(D) || hq >= n_heads) return;
const uint row = b * n_heads + hq;
float m = -as_type<float>(0x7f800000u);  // -inf
for (uint p = 0; p < parts; ++p) m = max(m, part_ml[2 * (row * parts + p)]);
float num = 0.0f, den = 0.0f;
for (uint p = 0; p < parts; ++p) {
  const float l = part_ml[2 * (row * parts + p) + 1];
  if (l > 0.0f) {
    const float w = l * exp(part_ml[2 * (row * parts + p)] - m);
    num = fma(w, part_out[(row * parts + p) * uint(D) + d], num);
    den += w;
  }
}
out[row * uint(D) + d] = half(den > 0.0f ? num / den : 0.0f);
