// Per-head RMSNorm (the unfused path's Q and K norms): x[rows, D] -> out, each row of D elements
// scaled by rsqrt(mean(x^2) + eps) * weight (fp16 in and out, fp32 math).
// One threadgroup of D/2 threads per row (rows along x: the y and z grids stop at 65535);
// thread i owns elements i and i + D/2.
// Constants: D. Inputs: x, weight (f32[D]), scalars (f32: eps).
constexpr uint NSIMD = (D / 2 + 31) / 32;
threadgroup float scratch[NSIMD];
const uint i = thread_position_in_threadgroup.x;
const uint row = threadgroup_position_in_grid.x;
const auto src = x + row * uint(D);
const float x0 = float(src[i]), x1 = float(src[i + D / 2]);
const float ss = threadgroup_sum<NSIMD>(x0 * x0 + x1 * x1, scratch, simdgroup_index_in_threadgroup,
                                        thread_index_in_simdgroup);
const float inv_rms = rsqrt(ss / float(D) + scalars[0]);
out[row * uint(D) + i] = half(x0 * inv_rms * weight[i]);
out[row * uint(D) + i + D / 2] = half(x1 * inv_rms * weight[i + D / 2]);
