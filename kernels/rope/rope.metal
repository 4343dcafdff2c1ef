// RoPE on x[seq, n_heads, D] -> out (fp16 in and out, fp32 math): `rope` (standard pairs) and
// `rope_neox` (split-half pairs) are this body with NEOX false / true.
//
// Thread (j, g, t) turns pairs 2j and 2j+1 of heads g*HPT .. g*HPT+HPT-1 of token t. The angles,
// the costly part, are computed once and applied to HPT heads, and all HPT heads are loaded
// before the first store, so that each thread has HPT loads in flight (memory-level parallelism
// is what a bandwidth-bound kernel lives on).
// Constants: D (a multiple of 4), NEOX, FREQ_TABLE (inverse frequencies from inv_freq[] or
//   computed inline), POSITION_IDS (token t sits at positions[t], else at positions[0] + t), HPT.
// Inputs: x, positions (int32), inv_freq (f32[D/2]), scalars (f32: theta, freq_scale),
//   dims (int32: seq, n_heads).
const uint j = thread_position_in_grid.x;
const uint g = thread_position_in_grid.y;
const uint t = thread_position_in_grid.z;
const uint seq = uint(dims[0]);
const uint n_heads = uint(dims[1]);
if (j >= uint(D / 4) || t >= seq) {
  return;
}
const float p = float(POSITION_IDS ? positions[t] : positions[0] + int(t)) * scalars[1];
const float angle0 = p * rope_inv_freq<D, FREQ_TABLE>(inv_freq, 2 * j, scalars[0]);
const float angle1 = p * rope_inv_freq<D, FREQ_TABLE>(inv_freq, 2 * j + 1, scalars[0]);
const float c0 = cos(angle0), s0 = sin(angle0), c1 = cos(angle1), s1 = sin(angle1);
half4 vals[HPT];
for (uint k = 0; k < uint(HPT); ++k) {
  const uint h = min(g * uint(HPT) + k, n_heads - 1);  // clamped: loads stay in bounds
  vals[k] = load_pairs2<D, NEOX>(x + (t * n_heads + h) * uint(D), j);
}
for (uint k = 0; k < uint(HPT); ++k) {
  const uint h = g * uint(HPT) + k;
  if (h < n_heads) {
    store_pairs2<D, NEOX>(out + (t * n_heads + h) * uint(D), j, rotate_pairs2(unpack_pairs2<NEOX>(vals[k]), c0, s0, c1, s1));
  }
}
