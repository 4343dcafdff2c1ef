// Probe of the SIMD-group functions. Thread i (of a 1-D grid of n threads) writes
// simd_sum, simd_max, simd_shuffle_xor(., MASK) and simd_broadcast_first of x over its SIMD group.
// Threads past the grid (CUDA only) take part with neutral values and write nothing.
// Constants: MASK. Inputs: x (float), dims (int32: n).
const uint i = thread_position_in_grid.x;
const bool inside = i < uint(dims[0]);
const float v = inside ? x[i] : 0.0f;
const float total = simd_sum(v);
const float largest = simd_max(inside ? v : -3.0e38f);
const float partner = simd_shuffle_xor(v, ushort(MASK));
const float first = simd_broadcast_first(v);
if (inside) {
  out[4 * i] = total;
  out[4 * i + 1] = largest;
  out[4 * i + 2] = partner;
  out[4 * i + 3] = first;
}
