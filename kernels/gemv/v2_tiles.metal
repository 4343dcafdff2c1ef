// The declarations of a v2 GEMV (gemv_v2.metal has the design): constants, threadgroup memory,
// thread ids. Included once at the top of a kernel body; v2_rows.metal then runs on them.
constexpr uint BB = QTYPE == 0 ? 18 : 34;      // bytes a block
constexpr uint TB = 64;                          // blocks a tile: a pair for each lane
constexpr uint PAIR_WORDS = BB / 2;              // 32-bit words of a block pair (9, 17)
constexpr uint QS_WORDS = (BB - 2) / 4;          // 32-bit words of a block's quants (4, 8)
constexpr uint ROW_WORDS = TB * BB / 4;          // a row's tile in 32-bit words
constexpr uint ROW_VECS = ROW_WORDS / 4;         // ... in 16-byte words (72, 136)
constexpr uint XPAD = 68;                        // 64 values of X' per lane, then 4 of padding:
constexpr uint XROW = XCHUNK / 64 * XPAD;        // lanes' 8-byte reads then hit distinct banks
constexpr uint STAGED = (R * ROW_VECS + 31) / 32;  // 16-byte words a lane loads per tile
constexpr uint NT = NSIMD * 32;

constexpr uint TILE_SLOTS = SLOTS > 1 ? SLOTS : 1;  // weight tiles a SIMD group holds
threadgroup uint4 w_tile[NSIMD * R * ROW_VECS * TILE_SLOTS];
threadgroup uint2 x_tile[M * XROW / 4];     // X' as int16, four to a uint2
threadgroup float x_scale[M * XCHUNK / 32];  // d_x of each block
threadgroup int x_sum[M * XCHUNK / 32];      // sum of each block's int16 values

const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
auto my_vecs = w_tile + simd * R * ROW_VECS * TILE_SLOTS;
threadgroup float inv_rms[M];       // LATHE_PROLOGUE 1: 1 / RMS of each row of X
threadgroup float scratch[NSIMD];   // ... and its threadgroup sum
