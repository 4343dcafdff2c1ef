// The declarations of a v3 GEMV (gemv_v3.metal has the design): constants that do not depend on
// K, threadgroup memory sized for XCHUNK, thread ids. Included once at the top of a kernel body
// (gemv_v3.metal, seam.metal); v3_rows.metal then runs one GEMV on them.
// QTYPE 0 Q4_0, 1 Q8_0, and the K-quants 2 Q4_K, 3 Q5_K, 4 Q6_K, whose repacked chunk is 32
// weights' low 4 bits in Q4_0's nibble order, their higher bits (HB bytes a chunk) and scales in
// regions of their own (reference/kquant.py has the layout).
constexpr bool KQUANT = QTYPE >= 2;
constexpr uint QB = QTYPE == 1 ? 32 : 16;    // bytes of a block's quants (K-quants: a chunk's low bits)
constexpr uint VALS = QTYPE == 1 ? 16 : 32;  // values of K in a chunk (16 bytes of quants)
constexpr uint HB = QTYPE == 3 ? 4 : QTYPE == 4 ? 8 : 0;  // K-quants: bytes of high bits a chunk
constexpr uint UNITS = VALS / 8;             // 16-byte words of staged X' a chunk reads
constexpr uint XC = XCHUNK / VALS;           // chunks of one X' chunk
constexpr uint NT = NSIMD * 32;

threadgroup uint4 x_tile[M * UNITS * XC];    // X' as int16: word u of chunk c at [u * XC + c]
threadgroup float x_scale[M * XCHUNK / 32];  // d_x of each block
threadgroup int x_sum[M * XCHUNK / 32];      // sum of each block's int16 values
threadgroup float inv_rms[M];                // LATHE_PROLOGUE 1: 1 / RMS of each row of X
threadgroup float scratch[NSIMD];            // ... and its threadgroup sum

const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
