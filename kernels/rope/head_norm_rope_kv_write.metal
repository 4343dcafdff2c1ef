// Qwen3's attention prologue in one dispatch: per-head RMSNorm of Q and K (each with its own
// weight), RoPE, and the KV-cache write (`head_norm_rope_neox_kv_write` is NEOX = true).
//
// One threadgroup of D/2 threads per (Q head h, token t); thread i owns pair i. Q head h and, if
// h < n_kv_heads, K and V head h are loaded first (all loads in flight together); phase 1 norms
// and rotates Q, phase 2 norms and rotates K, reusing the reduction scratch, and copies V.
// Both branches are uniform over the threadgroup, so every thread reaches the barriers inside
// threadgroup_sum.
// LATHE_PAGED (a batch of sequences over vLLM's block pool, as rope_kv_write.metal's): token t
// at position pos[t], its K and V at slots[t] of the paged caches (dst_rows: the pool's rows; a
// slot outside it is dropped).
// Constants: D (a multiple of 64), NEOX, FREQ_TABLE; paged: BS (rows a block).
// Inputs: q, k, v (token t at t * stride + offset, as rope_kv_write), q_weight, k_weight (f32[D]),
//   pos (int32[1]; paged: int32[seq]), inv_freq (f32[D/2]), scalars (f32: theta, freq_scale, eps),
//   dims (int32: seq, n_heads, n_kv_heads, dst_rows, q_stride, q_off, k_stride, k_off,
//   v_stride, v_off); paged: slots (int32[seq]).
constexpr uint NSIMD = D / 64;
threadgroup float scratch[NSIMD];
const uint i = thread_position_in_threadgroup.x;
const uint h = threadgroup_position_in_grid.y;
const uint t = threadgroup_position_in_grid.z;
const uint simd_id = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint n_heads = uint(dims[1]);
const uint n_kv = uint(dims[2]);
const uint dst_rows = uint(dims[3]);
const bool has_kv = h < n_kv;
const uint a = rope_first<D, NEOX>(i);
const uint b = rope_second<D, NEOX>(i);
const auto q_src = q + t * uint(dims[4]) + uint(dims[5]) + h * uint(D);
const uint kv_head = has_kv ? h : 0;  // heads past n_kv load head 0 and discard it
const auto k_src = k + t * uint(dims[6]) + uint(dims[7]) + kv_head * uint(D);
const auto v_src = v + t * uint(dims[8]) + uint(dims[9]) + kv_head * uint(D);
const float q0 = float(q_src[a]), q1 = float(q_src[b]);
const float k0 = float(k_src[a]), k1 = float(k_src[b]);
const half v0 = v_src[2 * i], v1 = v_src[2 * i + 1];

#if LATHE_PAGED
const uint slot = uint(slots[t]);  // a negative slot wraps past the pool: dropped
const bool row_in_cache = slot < dst_rows;
const float angle = float(pos[t]) * scalars[1] * rope_inv_freq<D, FREQ_TABLE>(inv_freq, i, scalars[0]);
#else
const bool row_in_cache = dst_row0 + t < dst_rows;
const float angle =
    float(pos[0] + int(t)) * scalars[1] * rope_inv_freq<D, FREQ_TABLE>(inv_freq, i, scalars[0]);
#endif
const float c = cos(angle);
const float s = sin(angle);
const float eps = scalars[2];

// Phase 1: Q head h.
{
  const float ss = threadgroup_sum<NSIMD>(q0 * q0 + q1 * q1, scratch, simd_id, lane);
  const float inv_rms = rsqrt(ss / float(D) + eps);
  const float x0 = q0 * inv_rms * q_weight[a], x1 = q1 * inv_rms * q_weight[b];
  const auto dst = q_out + (t * n_heads + h) * uint(D);
  dst[a] = half(x0 * c - x1 * s);
  dst[b] = half(x0 * s + x1 * c);
}
// Phase 2: K head h and V head h. Rows past the cache (a device-side position out of range)
// are dropped, not written.
if (has_kv) {
  const float ss = threadgroup_sum<NSIMD>(k0 * k0 + k1 * k1, scratch, simd_id, lane);
  const float inv_rms = rsqrt(ss / float(D) + eps);
  if (row_in_cache) {
    const float x0 = k0 * inv_rms * k_weight[a], x1 = k1 * inv_rms * k_weight[b];
#if LATHE_PAGED
    k_dst[paged_k_at<D, BS>(slot, h, n_kv, a)] = half(x0 * c - x1 * s);
    k_dst[paged_k_at<D, BS>(slot, h, n_kv, b)] = half(x0 * s + x1 * c);
    v_dst[paged_v_at<D, BS>(slot, h, n_kv, 2 * i)] = v0;
    v_dst[paged_v_at<D, BS>(slot, h, n_kv, 2 * i + 1)] = v1;
#else
    const uint row = (h * dst_rows + dst_row0 + t) * uint(D);
    k_dst[row + a] = half(x0 * c - x1 * s);
    k_dst[row + b] = half(x0 * s + x1 * c);
    v_dst[row + 2 * i] = v0;
    v_dst[row + 2 * i + 1] = v1;
#endif
  }
}
