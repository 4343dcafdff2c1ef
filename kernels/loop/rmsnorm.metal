// RMSNorm of each row of x[M, K] with gamma[K], fp16 in and out, fp32 sums; with LATHE_RESIDUAL
// the row is first x + residual, written out as `sum` (the next residual) beside the normalized
// `y` (the seeds' residual_rmsnorm: one read of each input, one write of each output).
// One threadgroup a row: NSIMD SIMD groups, 8 values (one 16-byte word) a thread a step.
// Constants: NSIMD. Inputs: x, (residual,) gamma, dims (int32: M, K), eps (float[1]).
// Outputs: y, (sum).
// LATHE_X32 1 (no residual): x is float32, a residual stream past fp16's range (Gemma's); y fp16.
// LATHE_POST_ADD 1 (no residual, fp16 x): a block's output normalized and added to the float32
// stream in one launch (Gemma's post-attention and post-FFN norms): y = stream + RMSNorm(x) *
// gamma, float32; input `stream` in place of `residual`.
#ifndef LATHE_POST_ADD
#define LATHE_POST_ADD 0
#endif
threadgroup float scratch[NSIMD];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_index_in_threadgroup;
const uint k = uint(dims[1]);
const uint words = k / 8;
float ss = 0.0f;
#if LATHE_X32
for (uint i = tid; i < words; i += NSIMD * 32) {
  for (uint q = 0; q < 2; ++q) {
    const uint4 a = load_wide<uint4>(x, 2 * (row * words + i) + q);
    const float f[4] = {as_type<float>(a.x), as_type<float>(a.y), as_type<float>(a.z), as_type<float>(a.w)};
    ss += f[0] * f[0] + f[1] * f[1] + f[2] * f[2] + f[3] * f[3];
  }
}
#else
for (uint i = tid; i < words; i += NSIMD * 32) {
  const uint4 a = load_wide<uint4>(x, row * words + i);
#if LATHE_RESIDUAL
  const uint4 r = load_wide<uint4>(residual, row * words + i);
  const uint ru[4] = {r.x, r.y, r.z, r.w};
#endif
  const uint au[4] = {a.x, a.y, a.z, a.w};
  uint out[4];
  for (uint j = 0; j < 4; ++j) {
    half2 h = as_type<half2>(au[j]);
#if LATHE_RESIDUAL
    const half2 rh = as_type<half2>(ru[j]);
    h = half2(half(float(h.x) + float(rh.x)), half(float(h.y) + float(rh.y)));
    out[j] = as_type<uint>(h);
#endif
    ss += float(h.x) * float(h.x) + float(h.y) * float(h.y);
  }
#if LATHE_RESIDUAL
  store_wide<uint4>(sum, row * words + i, uint4{out[0], out[1], out[2], out[3]});
#endif
}
#endif
const float inv = rsqrt(threadgroup_sum<NSIMD>(ss, scratch, simdgroup_index_in_threadgroup,
                                                thread_index_in_simdgroup) / float(k) + eps[0]);
for (uint i = tid; i < words; i += NSIMD * 32) {
#if LATHE_X32
  const uint4 lo = load_wide<uint4>(x, 2 * (row * words + i)), hi = load_wide<uint4>(x, 2 * (row * words + i) + 1);
  const uint au[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  float xv[8];
  for (uint j = 0; j < 8; ++j) xv[j] = as_type<float>(au[j]);
#else
#if LATHE_RESIDUAL
  const uint4 a = load_wide<uint4>(sum, row * words + i);  // this thread's own writes above
#else
  const uint4 a = load_wide<uint4>(x, row * words + i);
#endif
  const uint au[4] = {a.x, a.y, a.z, a.w};
  float xv[8];
  for (uint j = 0; j < 4; ++j) {
    const half2 h = as_type<half2>(au[j]);
    xv[2 * j] = float(h.x), xv[2 * j + 1] = float(h.y);
  }
#endif
  const uint4 g = load_wide<uint4>(gamma, i);
  const uint gu[4] = {g.x, g.y, g.z, g.w};
#if LATHE_POST_ADD
  uint sums[8];
  for (uint q = 0; q < 2; ++q) {
    const uint4 st = load_wide<uint4>(stream, 2 * (row * words + i) + q);
    const uint su[4] = {st.x, st.y, st.z, st.w};
    for (uint j = 0; j < 4; ++j) {
      const uint e = 4 * q + j;
      const half2 gh = as_type<half2>(gu[e / 2]);
      const float g = e % 2 ? float(gh.y) : float(gh.x);
      sums[e] = as_type<uint>(as_type<float>(su[j]) + xv[e] * inv * g);
    }
  }
  store_wide<uint4>(y, 2 * (row * words + i), uint4{sums[0], sums[1], sums[2], sums[3]});
  store_wide<uint4>(y, 2 * (row * words + i) + 1, uint4{sums[4], sums[5], sums[6], sums[7]});
#else
  uint out[4];
  for (uint j = 0; j < 4; ++j) {
    const half2 gh = as_type<half2>(gu[j]);
    out[j] = as_type<uint>(half2(half(xv[2 * j] * inv * float(gh.x)), half(xv[2 * j + 1] * inv * float(gh.y))));
  }
  store_wide<uint4>(y, row * words + i, uint4{out[0], out[1], out[2], out[3]});
#endif
}
