// One output value of a split decode attention from its partitions' partials (decode_attention.metal
// with LATHE_SPLIT): with M the largest of the partitions' maxima m_p, partition p weighs
// w_p = l_p * exp(m_p - M) (its softmax sum at the common max), and the value is
// sum_p w_p o_p / sum_p w_p. Empty partitions (past a shorter sequence's end: m = -inf, l = 0)
// weigh nothing. The includer's scope names: part_out[rows, P, D], part_ml[rows, P, 2], D, `row`
// (batch * query heads + query head), `parts` (P), `d`, and a float `merged` that this sets.
// Shared by combine.metal (its own launch) and decode_attention.metal's LATHE_MERGE (the last
// threadgroup of a head group to finish merges, in the same launch).
{
  float m_all = -as_type<float>(0x7f800000u);  // -inf
  for (uint p = 0; p < parts; ++p) m_all = max(m_all, part_ml[2 * (row * parts + p)]);
  float num = 0.0f, den = 0.0f;
  for (uint p = 0; p < parts; ++p) {
    const float l = part_ml[2 * (row * parts + p) + 1];
    if (l > 0.0f) {
      const float w = l * exp(part_ml[2 * (row * parts + p)] - m_all);
      num = fma(w, part_out[(row * parts + p) * uint(D) + d], num);
      den += w;
    }
  }
  merged = den > 0.0f ? num / den : 0.0f;
}
