// The declarations of a v3 GEMV (gemv_v3.metal has the design): constants that do not depend on
// K, threadgroup memory sized for XCHUNK, thread ids. Included once at the top of a kernel body
// (gemv_v3.metal, seam.metal); v3_rows.metal then runs one GEMV on them.
// QTYPE (0 Q4_0, 1 Q8_0, the K-quants 2 Q4_K, 3 Q5_K, 4 Q6_K, ...) sets how X' is laid out: Q8_0 16
// values a chunk, every other type 32 (its GEMVs then read conflict-free). Each GEMV of the launch
// has a block type of its own (QR, v3_rows.metal), which reads either layout.
constexpr uint VALS = QTYPE == 1 ? 16 : 32;  // values of K in a chunk (16 bytes of quants)
constexpr uint UNITS = VALS / 8;             // 16-byte words of staged X' a chunk reads
constexpr uint XC = XCHUNK / VALS;           // chunks of one X' chunk
constexpr uint NT = NSIMD * 32;

threadgroup uint4 x_tile[M * UNITS * XC];    // X' as int16: word u of chunk c at [u * XC + c]
threadgroup float x_scale[M * XCHUNK / 32];  // d_x of each block
threadgroup int x_sum[M * XCHUNK / 32];      // sum of each block's int16 values
threadgroup float inv_rms[M];                // LATHE_PROLOGUE 1: 1 / RMS of each row of X
#ifndef GEMV_RMS_LATE
#define GEMV_RMS_LATE 0
#endif
// ... and its threadgroup sum (GEMV_RMS_LATE: each row's SIMD groups' sums of squares, v3_rows.metal)
threadgroup float scratch[NSIMD * (GEMV_RMS_LATE ? M : 1)];

const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
