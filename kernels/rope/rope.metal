// RoPE on x[seq, n_heads, D] -> out (fp16 in and out, fp32 math): `rope` (standard pairs) and
// `rope_neox` (split-half pairs) are this body with NEOX false / true.
//
// Thread (i, g, t) turns pair i of heads g*HPT .. g*HPT+HPT-1 of token t: the angle, the costly
// part, is computed once and applied to HPT heads.
// Constants: D, NEOX, FREQ_TABLE (inverse frequencies from inv_freq[] or computed inline),
//   POSITION_IDS (token t sits at positions[t], else at positions[0] + t), HPT.
// Inputs: x, positions (int32), inv_freq (f32[D/2]), scalars (f32: theta, freq_scale),
//   dims (int32: seq, n_heads).
const uint i = thread_position_in_grid.x;
const uint g = thread_position_in_grid.y;
const uint t = thread_position_in_grid.z;
const uint seq = uint(dims[0]);
const uint n_heads = uint(dims[1]);
if (i >= uint(D / 2) || t >= seq) {
  return;
}
const int p = POSITION_IDS ? positions[t] : positions[0] + int(t);
const float angle = float(p) * scalars[1] * rope_inv_freq<D, FREQ_TABLE>(inv_freq, i, scalars[0]);
const float c = cos(angle);
const float s = sin(angle);
for (uint k = 0; k < uint(HPT); ++k) {
  const uint h = g * uint(HPT) + k;
  if (h < n_heads) {
    const uint base = (t * n_heads + h) * uint(D);
    rope_pair<D, NEOX>(x + base, out + base, i, c, s);
  }
}
