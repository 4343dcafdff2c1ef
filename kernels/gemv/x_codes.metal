// Stage one chunk of X' that another phase of the launch already quantized (x_stage.metal's
// form: int16 codes, and a scale and a code sum a block of 32), copied into threadgroup memory.
// The includer defines GEMV_X_CODES (int16 [M, k]), GEMV_X_SCALES (float [M, k / 32]) and
// GEMV_X_SUMS (int [M, k / 32]); the other names are x_stage.metal's (X_STORE, cb0, nb, k, ...).
// blocks/layer_block.metal's batch form: the attention tickets write the O phase's X' as they
// write attn_out, once, where each O ticket quantized all of it (decode_rows.metal, LATHE_OUT_CODES).
// Every thread of the threadgroup runs it; it begins and ends with a threadgroup barrier.
{
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint cnb = min(uint(XCHUNK / 32), nb - cb0);
  const uint halves = M * cnb * 2;
  // X_STAGE_ITEMS items a thread a pass, each item's loads from a valid address (x_stage.metal's
  // reason: all of a pass's loads out before the first store)
  for (uint base = 0; base < halves; base += X_STAGE_ITEMS * NT) {
    uint4 words[X_STAGE_ITEMS][2];
    LATHE_UNROLL for (uint u = 0; u < X_STAGE_ITEMS; ++u) {
      const uint i = min(base + u * NT + tid, halves - 1);
      const uint m = i / (cnb * 2), e = (i % (cnb * 2)) * 16;
      words[u][0] = load_wide<uint4>(GEMV_X_CODES + m * k, (cb0 * 32 + e) / 8);
      words[u][1] = load_wide<uint4>(GEMV_X_CODES + m * k, (cb0 * 32 + e) / 8 + 1);
    }
    LATHE_UNROLL for (uint u = 0; u < X_STAGE_ITEMS; ++u) {
      const uint i = base + u * NT + tid;
      if (i >= halves) continue;
      const uint m = i / (cnb * 2), e = (i % (cnb * 2)) * 16;
      const uint packed[8] = {words[u][0].x, words[u][0].y, words[u][0].z, words[u][0].w,
                              words[u][1].x, words[u][1].y, words[u][1].z, words[u][1].w};
      X_STORE(m, e, packed);
      if (i % 2 == 0) {
        x_scale[m * (XCHUNK / 32) + e / 32] = GEMV_X_SCALES[m * nb + cb0 + e / 32];
        x_sum[m * (XCHUNK / 32) + e / 32] = GEMV_X_SUMS[m * nb + cb0 + e / 32];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
