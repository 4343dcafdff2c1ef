// Quantized GEMV, v3: Y[M, N] = X'[M, K] @ W^T over weights repacked once when the model loads
// (kernels.gemv.repack; the GGUF file is never changed): a matrix's quants first, row after row,
// 16 bytes a block for Q4_0 (QTYPE 0: GGUF's nibble order) or 32 for Q8_0 (QTYPE 1), then its
// fp16 scales, row after row. Every 16 bytes of quants (a chunk: a Q4_0 block, half a Q8_0 one)
// then starts 16-byte aligned, so a lane loads its chunk straight into registers in one load and
// decodes it there: v2's round trip of the weights through threadgroup memory (and the shifts
// that joined blocks which GGUF packs across 4-byte words) is gone. Nsight Compute on v2 found
// it waiting on those shared-memory loads and on the fixed latency of its dot-product chains,
// at 22-35% occupancy (kernels/gemv/NOTES.md).
//
// X' (X, RMSNorm(X) * gamma, silu(gate) * up: LATHE_PROLOGUE) is staged in threadgroup memory as
// int16 with a scale per block of 32 (x_stage.metal, shared with v2), in XCHUNK values of K at
// a time (all of K in one chunk where it fits: every M = 1 shape up to K = 16384), laid out so
// that the 32 lanes of a SIMD group, on consecutive chunks, read consecutive 16-byte words.
// Each SIMD group takes R rows at a time (a row group; several, one after another, when the host
// launches fewer threadgroups than row groups: about one wave, X' staged once). Lane l takes
// chunks l, l + 32, ... of each row, P of them at a time: all R x P 16-byte loads are issued
// before any is used (the first P before X' is staged), then decoded with exact integer dot
// products (int16 X' by the 4-bit or int8 weights, two per dp2a on NVIDIA), scaled by d_w * d_x
// into fp32 sums; Q4_0's -8 is taken off as 8 * the block's sum of X' ints. A SIMD sum ends a row.
//
// Constants: QTYPE, M (rows of X, 1..4), R, NSIMD, P, K (a multiple of 32), XCHUNK (a multiple of
// 32, at most K rounded up), XITEMS (x_stage.metal's items a thread a pass: the gemv_x_items
// option). Inputs: x, w (the repacked bytes), dims (int32: N, K, threadgroups launched);
// prologue 1 adds gamma (half, K) and eps (float, 1); LATHE_RESIDUAL adds residual (half, [M, N])
// to Y before its one rounding. LATHE_EPILOGUE 1 (SwiGLU out, v3_rows.metal): W is
// [gate; up] and Y [M, N / 2] is silu(gate) * up of the two products, rounded once, so that the
// down projection that follows stages a plain X' (no exp, half the bytes).
//
// LATHE_PAIR 1: a second matrix, W_B (w_b, dims_b: N_B, K, its threadgroups), of a block type
// of its own (QTYPE_B) with its own R_B and P_B, whose N_B columns
// follow W's in Y [M, N + N_B]: threadgroups dims[2].. take its rows. A fused projection whose
// parts differ in type (llama.cpp's Q4_K_M: some layers' attn_v Q6_K beside Q4_K attn_q and
// attn_k) is then one launch, as it is where the parts share a type, with no join after it.
//
// LATHE_ARGMAX 1 (an output head for greedy decoding): the GEMV also writes `token` (int32 [M]),
// the first index of the largest value of each row of Y as written (half): argmax.metal's answer
// over these logits, without its launch and its second read of them. Lane 0 of each SIMD group
// keeps the best of the columns it writes (GEMV_ON_Y: rising, so a strict > keeps the first of
// equals); the threadgroup's best goes to its slot of `argmax_scratch` (uint32: word 0 a counter, zero
// between launches, alone on its 256-byte line; from word 64, M (value bits, index) pairs a
// threadgroup), and the last threadgroup to count itself in reads every slot, writes the tokens
// and sets the counter back to zero. Two launches on one scratch must be ordered (kernels.gemv's
// rmsnorm_gemv_argmax says how the decoder orders them). Not with LATHE_PAIR.
//
// The body is in two parts that seam.metal shares: v3_tiles.metal (declarations) and
// v3_rows.metal (the GEMV of one threadgroup's row groups).
#ifndef LATHE_ARGMAX
#define LATHE_ARGMAX 0
#endif
#define X_STAGE_ITEMS XITEMS
#include "gemv/v3_tiles.metal"
#if LATHE_ARGMAX
static_assert(!LATHE_PAIR, "a pair's two matrices are not one row of logits");
float best_v[M];
uint best_i[M];
for (uint m = 0; m < uint(M); ++m) {
  best_v[m] = -as_type<float>(0x7f800000u);
  best_i[m] = 0xffffffffu;
}
#define GEMV_ON_Y(m, col, out)        \
  if (float(out) > best_v[m]) {       \
    best_v[m] = float(out);           \
    best_i[m] = (col);                \
  }
#endif
{
  const uint launched = threadgroup_position_in_grid.x;
#if LATHE_PAIR
  const uint y_columns = uint(dims[0]) + uint(dims_b[0]);
  auto y_all = y;
#define GEMV_Y_STRIDE y_columns
  if (launched >= uint(dims[2])) {
    const uint group = launched - uint(dims[2]);
    auto y = y_all + uint(dims[0]);  // before `dims` is W_B's
    auto w = w_b;
    auto dims = dims_b;
    constexpr uint KR = K, RR = R_B, PR = P_B, QR = QTYPE_B;
#include "gemv/v3_rows.metal"
  } else
#endif
  {
    const uint group = launched;
    constexpr uint KR = K, RR = R, PR = P, QR = QTYPE;
#include "gemv/v3_rows.metal"
  }
#ifdef GEMV_Y_STRIDE
#undef GEMV_Y_STRIDE
#endif
}
#if LATHE_ARGMAX
threadgroup float am_v[NSIMD];  // (at the kernel's scope, as Metal has threadgroup memory declared)
threadgroup uint am_i[NSIMD];
threadgroup uint am_last;
{
  // (v, i) beats (bv, bi): larger, or equal and earlier (indices are unique, so the first of equals wins)
#define ARGMAX_TAKE(v, i)                                  \
  if ((v) > bv || ((v) == bv && (i) < bi)) {               \
    bv = (v);                                              \
    bi = (i);                                              \
  }
  const uint groups = uint(dims[2]);
  const uint launched = threadgroup_position_in_grid.x;
  auto slots = writable(argmax_scratch) + 64;
  for (uint m = 0; m < uint(M); ++m) {  // this threadgroup's best of each row, into its slot
    if (lane == 0) {
      am_v[simd] = best_v[m];
      am_i[simd] = best_i[m];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
      float bv = am_v[0];
      uint bi = am_i[0];
      for (uint s = 1; s < NSIMD; ++s) ARGMAX_TAKE(am_v[s], am_i[s])
      slots[2 * (launched * M + m)] = as_type<uint>(bv);
      slots[2 * (launched * M + m) + 1] = bi;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) {
    am_last = grid_signal(argmax_scratch) == groups - 1;  // after this thread's slot writes
    if (am_last) grid_reset(argmax_scratch, 1);           // after every other threadgroup's
  }
  threadgroup_barrier(mem_flags::mem_device);
  if (am_last) {
    for (uint m = 0; m < uint(M); ++m) {
      float bv = -as_type<float>(0x7f800000u);
      uint bi = 0xffffffffu;
      for (uint g = tid; g < groups; g += NT) {
        ARGMAX_TAKE(as_type<float>(slots[2 * (g * M + m)]), slots[2 * (g * M + m) + 1])
      }
      for (ushort off = 16; off > 0; off >>= 1) {
        const float ov = simd_shuffle_xor(bv, off);
        const uint oi = simd_shuffle_xor(bi, off);
        ARGMAX_TAKE(ov, oi)
      }
      if (lane == 0) {
        am_v[simd] = bv;
        am_i[simd] = bi;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (tid == 0) {
        for (uint s = 1; s < NSIMD; ++s) ARGMAX_TAKE(am_v[s], am_i[s])
        token[m] = int(bi);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
#undef ARGMAX_TAKE
}
#endif
