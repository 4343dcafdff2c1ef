// The includer's GEMV output as the next GEMV's X' (x_stage.metal's form: int16 codes, and a
// scale and a code sum a block of 32), quantized once by the last of the SIMD groups that write a
// block's columns, where each ticket of the next GEMV quantized all of it. Run by the whole SIMD
// group right after its row group's columns col0 .. col0 + RO - 1 of the M rows of Y are written
// (lane 0 wrote them: v3_rows.metal's epilogue). The includer defines GEMV_Y_COUNTS (uint, a
// counter a block, zero and left zero), GEMV_Y_CODES (int16 [M, n_out]), GEMV_Y_SCALES and
// GEMV_Y_SUMS (float, int [M, n_out / 32]); n_out a multiple of 32 (the host's).
// Each row group counts itself on its block once its columns are out (grid_signal: a release of
// lane 0's writes); the one that counts last sees the others' (grid_reset's acquire, which also
// zeroes the count for the next layer) and quantizes the block from the fp16 values written, by
// x_stage.metal's arithmetic: the codes, scale and sum the next GEMV would have staged, bit for bit.
{
  static_assert(32 % RO == 0, "a row group's columns lie in one block of 32");
  if (col0 < n_out) {
    const uint blk = col0 / 32;
    const uint writers = 32 / RO;  // row groups a block
    uint before = 0;
    if (lane == 0) {
      before = grid_signal(GEMV_Y_COUNTS + blk);
      if (before + 1 == writers) grid_reset(GEMV_Y_COUNTS + blk, 1);
    }
    before = simd_broadcast_first(before);
    if (before + 1 == writers) {
      simdgroup_barrier(mem_flags::mem_device);  // (lane 0's acquire, before the lanes' loads)
      float vs[M];  // every row's loads first: one trip to the L2 on this (the phase's last) path, not M
      for (uint m = 0; m < uint(M); ++m) vs[m] = float(y[m * y_stride + blk * 32 + lane]);
      for (uint m = 0; m < uint(M); ++m) {
        const float v = vs[m];
        const float block_max = simd_max(fabs(v));
        const float inv = code_inv(block_max);
        const int code = code_of(v, inv);
        GEMV_Y_CODES[m * n_out + blk * 32 + lane] = short(code);
        const int code_sum = simd_sum(code);
        if (lane == 0) {
          GEMV_Y_SCALES[m * (n_out / 32) + blk] = code_scale(block_max);
          GEMV_Y_SUMS[m * (n_out / 32) + blk] = code_sum;
        }
      }
    }
  }
}
