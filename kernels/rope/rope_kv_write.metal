// Fused RoPE + KV-cache write (fp16 in and out, fp32 math). One body for four kernels:
//   rope_qkv_write / rope_neox_qkv_write      decode: q, k, v are views of one QKV buffer;
//   rope_batch_kv_write / rope_neox_batch_...  prefill: q, k, v are separate [seq, heads * D].
// Token t of q/k/v starts at t * stride + offset (dims), its heads follow contiguously. Q is
// rotated into q_out[seq, n_heads, D]; K is rotated and V copied into rows pos + t of the
// head-major cache [n_kv_heads, max_seq, D] (or into k_rows/v_rows in the functional form; the
// prelude from runtime.cache_prelude defines k_dst, v_dst and dst_row0).
//
// Thread (j, g, t) handles pairs 2j, 2j+1 of rows g*HPT .. g*HPT+HPT-1 of token t, where rows
// 0 .. Hq-1 are Q heads, Hq .. Hq+Hkv-1 K heads and the next Hkv are V heads: heads beyond
// n_kv_heads rotate Q only. The angles are computed once per thread, and all HPT rows are loaded
// before the first store (see rope.metal).
// LATHE_PAGED (a batch of sequences over vLLM's block pool): token t sits at position pos[t] and
// its K and V go to slots[t] of the paged caches (store_half4_paged_k / _v), dst_rows being the
// pool's rows; a slot outside the pool is dropped.
// Constants: D (a multiple of 4), NEOX, FREQ_TABLE, HPT; paged: BS (rows a block).
// Inputs: q, k, v, pos (int32[1]; paged: int32[seq]), inv_freq (f32[D/2]), scalars (f32: theta,
//   freq_scale), dims (int32: seq, n_heads, n_kv_heads, dst_rows, q_stride, q_off, k_stride,
//   k_off, v_stride, v_off); paged: slots (int32[seq]).
const uint j = thread_position_in_grid.x;
const uint g = thread_position_in_grid.y;
const uint t = thread_position_in_grid.z;
const uint seq = uint(dims[0]);
const uint n_heads = uint(dims[1]);
const uint n_kv = uint(dims[2]);
const uint dst_rows = uint(dims[3]);
const uint n_rows = n_heads + 2 * n_kv;
if (j >= uint(D / 4) || t >= seq) {
  return;
}
// A position array read on the device (chained decode) cannot be checked before launch: rows
// past the cache are dropped instead of written out of bounds.
#if LATHE_PAGED
const uint slot = uint(slots[t]);  // a negative slot wraps past the pool: dropped
const bool row_in_cache = slot < dst_rows;
const float p = float(pos[t]) * scalars[1];
#else
const bool row_in_cache = dst_row0 + t < dst_rows;
const float p = float(pos[0] + int(t)) * scalars[1];
#endif
const float angle0 = p * rope_inv_freq<D, FREQ_TABLE>(inv_freq, 2 * j, scalars[0]);
const float angle1 = p * rope_inv_freq<D, FREQ_TABLE>(inv_freq, 2 * j + 1, scalars[0]);
const float c0 = cos(angle0), s0 = sin(angle0), c1 = cos(angle1), s1 = sin(angle1);
half4 vals[HPT];
for (uint r = 0; r < uint(HPT); ++r) {
  const uint row = min(g * uint(HPT) + r, n_rows - 1);  // clamped: loads stay in bounds
  if (row < n_heads) {
    vals[r] = load_pairs2<D, NEOX>(q + t * uint(dims[4]) + uint(dims[5]) + row * uint(D), j);
  } else if (row < n_heads + n_kv) {
    vals[r] = load_pairs2<D, NEOX>(k + t * uint(dims[6]) + uint(dims[7]) + (row - n_heads) * uint(D), j);
  } else {  // V is copied as it is: the pairing only fixes which elements this thread moves
    vals[r] = load_pairs2<D, NEOX>(v + t * uint(dims[8]) + uint(dims[9]) + (row - n_heads - n_kv) * uint(D), j);
  }
}
for (uint r = 0; r < uint(HPT); ++r) {
  const uint row = g * uint(HPT) + r;
  if (row < n_heads) {
    store_pairs2<D, NEOX>(q_out + (t * n_heads + row) * uint(D), j, rotate_pairs2(unpack_pairs2<NEOX>(vals[r]), c0, s0, c1, s1));
  } else if (row < n_heads + n_kv) {
    if (row_in_cache) {
      const uint h = row - n_heads;
      const Pairs2 rotated = rotate_pairs2(unpack_pairs2<NEOX>(vals[r]), c0, s0, c1, s1);
#if LATHE_PAGED
      store_half4_paged_k<D, NEOX, BS>(k_dst, slot, h, n_kv, j, pack_pairs2<NEOX>(rotated));
#else
      store_pairs2<D, NEOX>(k_dst + (h * dst_rows + dst_row0 + t) * uint(D), j, rotated);
#endif
    }
  } else if (row < n_rows && row_in_cache) {
    const uint h = row - n_heads - n_kv;
#if LATHE_PAGED
    store_half4_paged_v<D, NEOX, BS>(v_dst, slot, h, n_kv, j, vals[r]);
#else
    store_half4<D, NEOX>(v_dst + (h * dst_rows + dst_row0 + t) * uint(D), j, vals[r]);
#endif
  }
}
