// Fused RoPE + KV-cache write (fp16 in and out, fp32 math). One body for four kernels:
//   rope_qkv_write / rope_neox_qkv_write      decode: q, k, v are views of one QKV buffer;
//   rope_batch_kv_write / rope_neox_batch_...  prefill: q, k, v are separate [seq, heads * D].
// Token t of q/k/v starts at t * stride + offset (dims), its heads follow contiguously. Q is
// rotated into q_out[seq, n_heads, D]; K is rotated and V copied into rows pos + t of the
// head-major cache [n_kv_heads, max_seq, D] (or into k_rows/v_rows in the functional form; the
// prelude from runtime.cache_prelude defines k_dst, v_dst and dst_row0).
//
// Thread (i, g, t) handles pair i of rows g*HPT .. g*HPT+HPT-1 of token t, where rows
// 0 .. Hq-1 are Q heads, Hq .. Hq+Hkv-1 K heads and the next Hkv are V heads: heads beyond
// n_kv_heads rotate Q only, and the angle is computed once per thread.
// Constants: D, NEOX, FREQ_TABLE, HPT.
// Inputs: q, k, v, pos (int32[1]), inv_freq (f32[D/2]), scalars (f32: theta, freq_scale),
//   dims (int32: seq, n_heads, n_kv_heads, dst_rows, q_stride, q_off, k_stride, k_off,
//   v_stride, v_off).
const uint i = thread_position_in_grid.x;
const uint g = thread_position_in_grid.y;
const uint t = thread_position_in_grid.z;
const uint seq = uint(dims[0]);
const uint n_heads = uint(dims[1]);
const uint n_kv = uint(dims[2]);
const uint dst_rows = uint(dims[3]);
if (i >= uint(D / 2) || t >= seq) {
  return;
}
// A position array read on the device (chained decode) cannot be checked before launch: rows
// past the cache are dropped instead of written out of bounds.
const bool row_in_cache = dst_row0 + t < dst_rows;
const float angle =
    float(pos[0] + int(t)) * scalars[1] * rope_inv_freq<D, FREQ_TABLE>(inv_freq, i, scalars[0]);
const float c = cos(angle);
const float s = sin(angle);
for (uint r = 0; r < uint(HPT); ++r) {
  const uint row = g * uint(HPT) + r;
  if (row < n_heads) {
    rope_pair<D, NEOX>(q + t * uint(dims[4]) + uint(dims[5]) + row * uint(D),
                       q_out + (t * n_heads + row) * uint(D), i, c, s);
  } else if (row < n_heads + n_kv && row_in_cache) {
    const uint h = row - n_heads;
    rope_pair<D, NEOX>(k + t * uint(dims[6]) + uint(dims[7]) + h * uint(D),
                       k_dst + (h * dst_rows + dst_row0 + t) * uint(D), i, c, s);
  } else if (row >= n_heads + n_kv && row < n_heads + 2 * n_kv && row_in_cache) {
    const uint h = row - n_heads - n_kv;
    const uint src = t * uint(dims[8]) + uint(dims[9]) + h * uint(D) + 2 * i;
    const uint dst = (h * dst_rows + dst_row0 + t) * uint(D) + 2 * i;
    v_dst[dst] = v[src];
    v_dst[dst + 1] = v[src + 1];
  }
}
