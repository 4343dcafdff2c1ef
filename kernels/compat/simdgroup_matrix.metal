// Probe of the 8x8 SIMD-group matrices (simdgroup_half8x8 / simdgroup_float8x8) in one SIMD group.
// Inputs: big (half [16, 16]), c (float [8, 8]), dims (int32: column, row).
// A is big's 8x8 block from (row, column) = (dims[1], dims[0]) (an odd column: a pair that
// straddles 4-byte words); B is big's block from (8, 8).
//   out[0] = A * B + C (fp32 accumulation)       out[1] = A * B + C (fp16 accumulation)
//   out[2] = A^T * B^T (both loaded transposed)   out[3] = A^T, stored by a transposed store of A
//   out[4] = C^T (a float matrix stored transposed) out[5] = A * B + C read back through
//   thread_elements() at (sg8x8_row, sg8x8_col + i) out[6] row r: sg8x8_row_sum / sg8x8_row_max
//   of A * B + C's row r in columns 0 and 1 (the rest zero).
//   out[7] = C + A B + A^T B^T (sg8x8_mma_k16)      out[8], out[9] = C + A B + A^T B^T and
//   C + B B + B^T B^T (sg8x8_mma_k16x2: two row blocks, A and B as the first's, B and B^T as
//   the second's)
// Outputs: out (float [10, 8, 8]), scratch (half [2, 8, 8]; the half stores land there first).
const uint lane = thread_index_in_simdgroup;
const uint a0 = uint(dims[1]) * 16 + uint(dims[0]);
simdgroup_half8x8 a, b, at_, bt_;
simdgroup_float8x8 cf, acc;
simdgroup_half8x8 ch;
simdgroup_load(a, big + a0, 16);
simdgroup_load(b, big + 8 * 16 + 8, 16);
simdgroup_load(at_, big + a0, 16, 0, true);
simdgroup_load(bt_, big + 8 * 16 + 8, 16, 0, true);
simdgroup_load(cf, c, 8);
ch = make_filled_simdgroup_matrix<half, 8, 8>(half(0.0f));
// C in half: its elements through thread_elements(), at the fragment layout's coordinates.
{
  const uint r = sg8x8_row(lane), col = sg8x8_col(lane);
  ch.thread_elements().x = half(c[r * 8 + col]);
  ch.thread_elements().y = half(c[r * 8 + col + 1]);
}
simdgroup_multiply_accumulate(acc, a, b, cf);
simdgroup_store(acc, out, 8);
simdgroup_half8x8 acc_h;
simdgroup_multiply_accumulate(acc_h, a, b, ch);
simdgroup_store(acc_h, scratch, 8);
simdgroup_float8x8 tt;
simdgroup_multiply(tt, at_, bt_);
simdgroup_store(tt, out + 2 * 64, 8);
simdgroup_store(a, scratch + 64, 8, 0, true);
simdgroup_store(cf, out + 4 * 64, 8, 0, true);
{
  const uint r = sg8x8_row(lane), col = sg8x8_col(lane);
  const float e0 = acc.thread_elements().x, e1 = acc.thread_elements().y;
  out[5 * 64 + r * 8 + col] = e0;
  out[5 * 64 + r * 8 + col + 1] = e1;
  const float s = sg8x8_row_sum(e0 + e1), m = sg8x8_row_max(max(e0, e1));
  if (col == 0) {
    out[6 * 64 + r * 8] = s;
    out[6 * 64 + r * 8 + 1] = m;
    for (uint k = 2; k < 8; ++k) out[6 * 64 + r * 8 + k] = 0.0f;
  }
}
{
  simdgroup_float8x8 k16, x0, x1;
  simdgroup_load(k16, c, 8);
  simdgroup_load(x0, c, 8);
  simdgroup_load(x1, c, 8);
  sg8x8_mma_k16(k16, a, at_, b, bt_);
  sg8x8_mma_k16x2(x0, x1, a, at_, b, bt_, b, bt_);
  simdgroup_store(k16, out + 7 * 64, 8);
  simdgroup_store(x0, out + 8 * 64, 8);
  simdgroup_store(x1, out + 9 * 64, 8);
}
simdgroup_barrier(mem_flags::mem_device);
for (uint i = lane; i < 64; i += 32) {
  out[64 + i] = float(scratch[i]);
  out[3 * 64 + i] = float(scratch[64 + i]);
}
