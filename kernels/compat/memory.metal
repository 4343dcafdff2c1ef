// Probe of threadgroup memory, barriers, lathe.h's threadgroup_sum, half conversions and wide
// (16-byte uint4, 4-byte half2) loads and stores, over a 1-D grid of n threads in groups of TG.
//   rev[i]   = 2 * x[the thread mirrored in i's threadgroup] (0 past the grid), as half
//   sums[i]  = sum of x over i's threadgroup
//   wide_out = wide_in, copied as uint4 (n4 = n / 4 words); pairs_out = pairs_in with each half2's
//              two halves swapped (n / 2 pairs); quads_out = pairs_in with each half4's .xy and
//              .zw swapped (n / 4 quads)
// Constants: TG (threads per threadgroup, a multiple of 32). Inputs: x (half), wide_in (uint32),
//   pairs_in (half), dims (int32: n).
threadgroup float buf[TG];
threadgroup float scratch[TG / 32];
const uint n = uint(dims[0]);
const uint i = thread_position_in_grid.x;
const uint l = thread_index_in_threadgroup;
const bool inside = i < n;
buf[l] = inside ? float(x[i]) : 0.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
const float mirrored = buf[TG - 1 - l];
const float total = threadgroup_sum<TG / 32>(buf[l], scratch, simdgroup_index_in_threadgroup,
                                             thread_index_in_simdgroup);
if (inside) {
  rev[i] = half(2.0f * mirrored);
  sums[i] = total;
}
if (i < n / 4) {
  store_wide<uint4>(wide_out, i, load_wide<uint4>(wide_in, i));
}
if (i < n / 2) {
  const half2 h = load_wide<half2>(pairs_in, i);
  half2 swapped;
  swapped.x = h.y;
  swapped.y = h.x;
  store_wide<half2>(pairs_out, i, swapped);
}
if (i < n / 4) {
  const half4 w = load_wide<half4>(pairs_in, i);
  half4 r;
  r.xy = w.zw;
  r.zw = w.xy;
  store_wide<half4>(quads_out, i, r);
}
