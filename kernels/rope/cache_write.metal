// Unfused KV-cache write: rows[seq, n_kv_heads * D] (token t at t * stride + offset) into the
// head-major cache [n_kv_heads, max_seq, D] at rows pos .. pos + seq - 1. The K write and the V
// write of the unfused path are one launch each of this body.
// Thread (e2, h, t) copies elements 2*e2, 2*e2+1 of head h of token t.
// Constants: D. Inputs: src, pos (int32[1]), dims (int32: seq, n_kv_heads, dst_rows, stride, off).
const uint e2 = thread_position_in_grid.x;
const uint h = thread_position_in_grid.y;
const uint t = thread_position_in_grid.z;
const uint dst_rows = uint(dims[2]);
// Rows past the cache (a device-side position out of range) are dropped, not written.
if (e2 >= uint(D / 2) || h >= uint(dims[1]) || t >= uint(dims[0]) || dst_row0 + t >= dst_rows) {
  return;
}
const uint from = t * uint(dims[3]) + uint(dims[4]) + h * uint(D) + 2 * e2;
const uint to = (h * dst_rows + dst_row0 + t) * uint(D) + 2 * e2;
kv_dst[to] = src[from];
kv_dst[to + 1] = src[from + 1];
