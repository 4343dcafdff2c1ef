// Qwen3's attention prologue in one dispatch: per-head RMSNorm of Q and K (each with its own
// weight), RoPE, and the KV-cache write (`head_norm_rope_neox_kv_write` is NEOX = true).
//
// One threadgroup of D/2 threads per (Q head h, token t); thread i owns pair i. Phase 1 norms and
// rotates Q head h; if h < n_kv_heads, phase 2 does the same for K head h, reusing the
// reduction scratch, and copies V head h. Both branches are uniform over the threadgroup, so the
// barriers inside threadgroup_sum are reached by every thread.
// Constants: D, NEOX, FREQ_TABLE.
// Inputs: q, k, v (token t at t * stride + offset, as rope_kv_write), q_weight, k_weight (f32[D]),
//   pos (int32[1]), inv_freq (f32[D/2]), scalars (f32: theta, freq_scale, eps),
//   dims (int32: seq, n_heads, n_kv_heads, dst_rows, q_stride, q_off, k_stride, k_off,
//   v_stride, v_off).
constexpr uint NSIMD = (D / 2 + 31) / 32;
threadgroup float scratch[NSIMD];
const uint i = thread_position_in_threadgroup.x;
const uint h = threadgroup_position_in_grid.y;
const uint t = threadgroup_position_in_grid.z;
const uint simd_id = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint n_heads = uint(dims[1]);
const uint n_kv = uint(dims[2]);
const uint dst_rows = uint(dims[3]);
const uint a = rope_first<D, NEOX>(i);
const uint b = rope_second<D, NEOX>(i);
const float angle =
    float(pos[0] + int(t)) * scalars[1] * rope_inv_freq<D, FREQ_TABLE>(inv_freq, i, scalars[0]);
const float c = cos(angle);
const float s = sin(angle);
const float eps = scalars[2];

// Phase 1: Q head h.
{
  const auto src = q + t * uint(dims[4]) + uint(dims[5]) + h * uint(D);
  const float x0 = float(src[a]), x1 = float(src[b]);
  const float ss = threadgroup_sum<NSIMD>(x0 * x0 + x1 * x1, scratch, simd_id, lane);
  const float inv_rms = rsqrt(ss / float(D) + eps);
  rope_pair<D, NEOX>(src, q_out + (t * n_heads + h) * uint(D), i, c, s,
                     inv_rms * q_weight[a], inv_rms * q_weight[b]);
}
// Phase 2: K head h and V head h.
if (h < n_kv) {
  const auto src = k + t * uint(dims[6]) + uint(dims[7]) + h * uint(D);
  const float x0 = float(src[a]), x1 = float(src[b]);
  const float ss = threadgroup_sum<NSIMD>(x0 * x0 + x1 * x1, scratch, simd_id, lane);
  const float inv_rms = rsqrt(ss / float(D) + eps);
  // Rows past the cache (a device-side position out of range) are dropped, not written.
  if (dst_row0 + t < dst_rows) {
    const uint dst = (h * dst_rows + dst_row0 + t) * uint(D);
    rope_pair<D, NEOX>(src, k_dst + dst, i, c, s, inv_rms * k_weight[a], inv_rms * k_weight[b]);
    const auto vsrc = v + t * uint(dims[8]) + uint(dims[9]) + h * uint(D);
    v_dst[dst + 2 * i] = vsrc[2 * i];
    v_dst[dst + 2 * i + 1] = vsrc[2 * i + 1];
  }
}
