// Device copy with 16-byte accesses: the workload that measures the device's memory peak
// (bytes read + bytes written over time). Constants: none. Inputs: src (uint32), dims (int32: n16,
// the number of 16-byte words). One thread per 16-byte word.
const uint i = thread_position_in_grid.x;
if (i < uint(dims[0])) {
  store_wide<uint4>(dst, i, load_wide<uint4>(src, i));
}
