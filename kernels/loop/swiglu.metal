// The gated FFN's activation of a fused gate+up output: y[m, i] = act(gu[m, i]) * gu[m, F + i],
// fp32 math; act SiLU (SwiGLU), or GELU (GeGLU, Gemma) where the prelude sets LATHE_ACT 1.
// Thread: 8 values (one 16-byte word of gate, one of up). Inputs: gu[M, 2F], dims (int32: M, F).
// Output: y[M, F].
const uint f = uint(dims[1]);
const uint words = f / 8;
const uint gid = thread_position_in_grid.x;
if (gid >= uint(dims[0]) * words) return;
const uint m = gid / words, i = gid % words;
const uint4 g = load_wide<uint4>(gu, m * 2 * words + i);
const uint4 u = load_wide<uint4>(gu, m * 2 * words + words + i);
const uint gw[4] = {g.x, g.y, g.z, g.w};
const uint uw[4] = {u.x, u.y, u.z, u.w};
uint out[4];
for (uint j = 0; j < 4; ++j) {
  const half2 gh = as_type<half2>(gw[j]);
  const half2 uh = as_type<half2>(uw[j]);
  const float a = float(gh.x), b = float(gh.y);
  out[j] = as_type<uint>(half2(half(gate_act<LATHE_ACT>(a) * float(uh.x)),
                               half(gate_act<LATHE_ACT>(b) * float(uh.y))));
}
store_wide<uint4>(y, gid, uint4{out[0], out[1], out[2], out[3]});
