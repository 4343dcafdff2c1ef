// Probe of the thread-id mappings: every thread inside the grid writes 16 floats at its flat grid
// index: position in grid (3), threadgroup position (3), position in threadgroup (3), threads per
// threadgroup (3), index in threadgroup, index in SIMD group, SIMD group index, and 1 (written).
// Inputs: dims (int32: grid x, y, z in threads). Threads past the grid (CUDA rounds it up to
// whole threadgroups) must write nothing.
const uint gx = uint(dims[0]), gy = uint(dims[1]), gz = uint(dims[2]);
const uint3 p = thread_position_in_grid;
if (p.x >= gx || p.y >= gy || p.z >= gz) {
  return;
}
const uint3 tg = threadgroup_position_in_grid;
const uint3 local = thread_position_in_threadgroup;
const uint3 size = threads_per_threadgroup;
auto o = ids + ((p.z * gy + p.y) * gx + p.x) * 16;
o[0] = float(p.x); o[1] = float(p.y); o[2] = float(p.z);
o[3] = float(tg.x); o[4] = float(tg.y); o[5] = float(tg.z);
o[6] = float(local.x); o[7] = float(local.y); o[8] = float(local.z);
o[9] = float(size.x); o[10] = float(size.y); o[11] = float(size.z);
o[12] = float(thread_index_in_threadgroup);
o[13] = float(thread_index_in_simdgroup);
o[14] = float(simdgroup_index_in_threadgroup);
o[15] = 1.0f;
