// The second launch of a split qmm (qmm.metal's LATHE_SPLIT): Y[m, col] from the KS threadgroups'
// float32 partial sums of row col (part [KS, M, N]), added in order, then the epilogue qmm has
// without a split: act(gate) * up (LATHE_GATED: gate at col, up at N / 2 + col) and the residual,
// in float32 before Y's one rounding. A thread an output.
//
// LATHE_NORM_OUT 1 (with the residual, not gated, N a multiple of 8): Y is the residual stream,
// and the launch also writes H = RMSNorm(Y) * gamma, the next block's input, so that no rmsnorm
// launch follows. A threadgroup a row, laid out as rmsnorm.metal's (NSIMD SIMD groups, 8 values a
// thread a step, its expressions), NSIMD by N (kernels.gemv.qmm_reduce_nsimd): where it is
// rmsnorm's, H is that launch's H bit for bit; wider rows take more SIMD groups, whose loads of
// the KS parts are all in flight at once (the threadgroups are only M), and sum in another order.
//
// Constants: M, KS (LATHE_NORM_OUT: NSIMD). Inputs: part (float [KS, M, N]), dims (int32: N, K);
// LATHE_RESIDUAL: residual (half [M, N_out]); LATHE_NORM_OUT: gamma (half [N]), eps (float[1]).
// Output: y (half [M, N_out]; N_out = N, or N / 2 gated); LATHE_NORM_OUT: h (half [M, N]).
#ifndef LATHE_NORM_OUT
#define LATHE_NORM_OUT 0
#endif
#if LATHE_NORM_OUT
threadgroup float scratch[NSIMD];
const uint n = uint(dims[0]), words = n / 8;
const uint m = threadgroup_position_in_grid.x;
const uint tid = thread_index_in_threadgroup;
float ss = 0.0f;
for (uint i = tid; i < words; i += NSIMD * 32) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (uint s = 0; s < KS; ++s) {
    for (uint q = 0; q < 2; ++q) {  // 8 floats: two 16-byte words of part's row
      const uint4 p = load_wide<uint4>(part, 2 * ((s * M + m) * words + i) + q);
      acc[4 * q] += as_type<float>(p.x), acc[4 * q + 1] += as_type<float>(p.y);
      acc[4 * q + 2] += as_type<float>(p.z), acc[4 * q + 3] += as_type<float>(p.w);
    }
  }
  const uint4 r = load_wide<uint4>(residual, m * words + i);
  const uint ru[4] = {r.x, r.y, r.z, r.w};
  uint out[4];
  for (uint j = 0; j < 4; ++j) {
    const half2 rh = as_type<half2>(ru[j]);
    const half2 h2 = half2(half(acc[2 * j] + float(rh.x)), half(acc[2 * j + 1] + float(rh.y)));
    out[j] = as_type<uint>(h2);
    ss += float(h2.x) * float(h2.x) + float(h2.y) * float(h2.y);  // rmsnorm.metal's expression
  }
  store_wide<uint4>(y, m * words + i, uint4{out[0], out[1], out[2], out[3]});
}
const float inv = rsqrt(threadgroup_sum<NSIMD>(ss, scratch, simdgroup_index_in_threadgroup,
                                                thread_index_in_simdgroup) / float(n) + eps[0]);
for (uint i = tid; i < words; i += NSIMD * 32) {
  const uint4 a = load_wide<uint4>(y, m * words + i);  // this thread's own writes above
  const uint au[4] = {a.x, a.y, a.z, a.w};
  const uint4 g = load_wide<uint4>(gamma, i);
  const uint gu[4] = {g.x, g.y, g.z, g.w};
  uint out[4];
  for (uint j = 0; j < 4; ++j) {
    const half2 v = as_type<half2>(au[j]);
    const float xv[2] = {float(v.x), float(v.y)};
    const half2 gh = as_type<half2>(gu[j]);
    out[j] = as_type<uint>(half2(half(xv[0] * inv * float(gh.x)), half(xv[1] * inv * float(gh.y))));
  }
  store_wide<uint4>(h, m * words + i, uint4{out[0], out[1], out[2], out[3]});
}
#else
const uint n = uint(dims[0]);
const uint n_out = LATHE_GATED ? n / 2 : n;
const uint i = thread_position_in_grid.x;
if (i >= M * n_out) return;
const uint m = i / n_out, col = i % n_out;
#define QMM_Y_AT i
#include "gemv/qmm_add_parts.metal"
#undef QMM_Y_AT
#endif
