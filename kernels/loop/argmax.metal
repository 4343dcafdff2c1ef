// Greedy sampling on the device: the index of the largest value of each row of logits[M, V]
// (float32; the first index among equals, as numpy's argmax), written as int32 so that the next
// step's embedding reads it without a host round trip. NaN rows are not special-cased.
// One threadgroup a row. Constants: NSIMD. Inputs: logits, dims (int32: M, V). Output: token.
threadgroup float best_v[NSIMD];
threadgroup uint best_i[NSIMD];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint v = uint(dims[1]);
float bv = -as_type<float>(0x7f800000u);
uint bi = 0xffffffffu;
for (uint i = tid; i < v; i += NSIMD * 32) {
  const float a = logits[row * v + i];
  if (a > bv) {  // strictly: a thread's indices rise, so the first of equals stays
    bv = a;
    bi = i;
  }
}
for (ushort off = 16; off > 0; off >>= 1) {
  const float ov = simd_shuffle_xor(bv, off);
  const uint oi = simd_shuffle_xor(bi, off);
  if (ov > bv || (ov == bv && oi < bi)) {
    bv = ov;
    bi = oi;
  }
}
if (lane == 0) {
  best_v[simd] = bv;
  best_i[simd] = bi;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  for (uint s = 1; s < NSIMD; ++s) {
    if (best_v[s] > bv || (best_v[s] == bv && best_i[s] < bi)) {
      bv = best_v[s];
      bi = best_i[s];
    }
  }
  token[row] = int(bi);
}
