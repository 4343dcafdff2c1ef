// Quantized GEMV, v2: Y[M, N] = X'[M, K] @ W^T, W in GGUF blocks (Q4_0: QTYPE 0, 18 bytes a
// block; Q8_0: QTYPE 1, 34 bytes; see gemv.metal), fp16 in and out, fp32 sums across blocks.
//
// X' (X, or RMSNorm(X) * gamma, or silu(gate) * up: LATHE_PROLOGUE, set by the prelude) is
// staged in threadgroup memory once per chunk of XCHUNK values of K (one chunk when it fits,
// which is every M = 1 shape up to K = 16384) as int16 with one scale per block of 32: 1/32767
// of its largest magnitude (relative error ~1e-5, against fp16's 5e-4 on X itself).
// Then each SIMD group walks its row groups (R rows each; several when the host launches fewer
// threadgroups than row groups, see below) on its own, in tiles of 64 blocks:
//  1. store the tile's weights, loaded earlier into registers, to its own threadgroup slice
//     (ALIGNED: 16-byte words, a SIMD group's loads covering each row contiguously; otherwise
//     rows start only 2-byte aligned and are copied in 2-byte words);
//  2. load the next tile into registers (in flight while 3 runs; SLOTS > 1: copied straight
//     into threadgroup memory instead, and step 1 falls away);
//  3. lane l takes blocks 2l and 2l+1 of each row (a pair starts on a 4-byte boundary), its
//     X' values reused across the R rows. Inside a block the products are exact integer dot
//     products (int16 X' by the int8 or 4-bit weights, two per dp2a instruction on NVIDIA:
//     under one instruction a weight, where a float decode takes three); a block's sum is
//     scaled by d_w * d_x into the fp32 total. Q4_0's -8 is taken off as 8 * sum(X' ints).
// Only chunk changes synchronize the threadgroup; a SIMD sum per row ends it.
//
// Constants: QTYPE, M (rows of X, 1..4), R (rows per SIMD group), NSIMD (SIMD groups per
// threadgroup), ALIGNED (K a multiple of 256: rows start 16-byte aligned), XCHUNK (values of K
// staged at once, a multiple of 2048), SLOTS (0: steps 1-2 above, the next tile in registers;
// 2 or more, ALIGNED only: the tiles copied straight into SLOTS threadgroup slots of the SIMD
// group, all SLOTS issued at the start and SLOTS - 1 in flight after, no register staging and
// no store step).
// Inputs: x, w (bytes), dims (int32: N, K, threadgroups launched); prologue 1 adds gamma
// (half, K) and eps (float, 1).
// LATHE_RESIDUAL 1 (the epilogue) adds residual (half, [M, N]) to Y before its one rounding:
// the decode loop's residual add (x + W o, x + W_down a) without a launch of its own.
//
// The body is in two parts that seam.metal shares: v2_tiles.metal (declarations) and
// v2_rows.metal (the GEMV of one threadgroup's row groups).
#include "gemv/v2_tiles.metal"
{
  const uint group = threadgroup_position_in_grid.x;
#include "gemv/v2_rows.metal"
}
