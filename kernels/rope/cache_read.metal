// Rows start .. start+n-1 of a head-major cache [n_kv_heads, max_seq, D] -> rows[n_kv, n, D].
// `after` is never read: taking an in-place write's ordering token as an input is what orders
// this read after the write (MLX orders GPU work by the buffers ops consume and produce).
// Constants: D. Inputs: cache, after, dims (int32: start, n, max_seq).
const uint e = thread_position_in_grid.x;
const uint r = thread_position_in_grid.y;
const uint h = thread_position_in_grid.z;
const uint n = uint(dims[1]);
if (e < uint(D) && r < n) {
  rows[(h * n + r) * uint(D) + e] = cache[(h * uint(dims[2]) + uint(dims[0]) + r) * uint(D) + e];
}
