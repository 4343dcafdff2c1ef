// Merges the partitions of a split decode attention (decode_attention.metal with LATHE_SPLIT and
// no LATHE_MERGE) in a launch of its own: the weighting is merge.metal's.
// Thread (d, hq, b). Constants: D. Inputs: part_out[B, Hq, P, D], part_ml[B, Hq, P, 2],
// dims (int32: Hq, P). Output: out[B, Hq, D] (half).
const uint d = thread_position_in_grid.x;
const uint hq = thread_position_in_grid.y;
const uint b = thread_position_in_grid.z;
const uint n_heads = uint(dims[0]);
const uint parts = uint(dims[1]);
if (d >= uint(D) || hq >= n_heads) return;
const uint row = b * n_heads + hq;
float merged;
#include "attention/merge.metal"
out[row * uint(D) + d] = half(merged);
