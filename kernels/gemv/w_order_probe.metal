// A probe of the memory system, not a kernel of the decode path: it reads a matrix of 16-byte words
// (N rows of CHUNKS_K words, as the repacked Q4_0 quants lie) once, in the order a SIMD group of a
// GEMM issues its weight loads, and does nothing with them but XOR them together. qmm at 16 rows
// reads W at about 40% of the copy peak whatever it keeps in flight (pf, W's ring, staged X:
// kernels/gemv/NOTES.md), where the v3 GEMV streams the same bytes at 70-90%. The two differ in
// what one load instruction of a SIMD group covers, which this probe isolates:
// - ORDER 0, qmm's: lane l takes word 4 s + l % 4 of row 8 b + l / 4 (a B fragment's rows and
//   chunks): 8 pieces of 64 bytes, 2 KiB apart (K = 4096); a row's next 64 bytes a super-chunk later;
// - ORDER 1, the v3 GEMV's: one row's 32 consecutive words (512 bytes) an instruction, the block's
//   8 rows in turn;
// - ORDER 2, a layout with the 8 rows of a block interleaved a super-chunk at a time (what qmm's
//   fragments would read if the repack put them so): 512 bytes an instruction, the block's whole
//   8 x K read as one run.
// Each SIMD group takes NB blocks of 8 rows at once (NB copies a lane a super-chunk, as qmm's NB
// row blocks) and keeps DEPTH super-chunks of them in flight: cp.async into a ring of DEPTH + 1
// slots of threadgroup memory that only the lane that copies a word reads back, one commit group a
// super-chunk, a slot refilled a super-chunk after it was read. (Loads into registers would not hold the depth: ptxas folds each into the XOR as
// it comes, 30 registers at NB 4 and DEPTH 4.) The GROUPS threadgroups of 4 SIMD groups (0: one
// block group each) stride over the block groups, so that the warps an SM holds can be set as
// qmm's grid and registers set them. Every ORDER reads every word once: the XOR of all the lanes'
// outputs is the XOR of the matrix (the check).
// Constants: ORDER, NB, DEPTH, GROUPS, N (a multiple of 8 * NB), CHUNKS_K (a multiple of 32).
// Inputs: w (uint4 words as uint [N * CHUNKS_K * 4]). Output: out (uint [threads launched]).
constexpr uint SUPERS = CHUNKS_K / 4;  // super-chunks a row (4 words each)
constexpr uint ITEMS = N / (8 * NB);   // groups of NB row blocks
constexpr uint WARPS = (GROUPS > 0 ? GROUPS : (ITEMS + 3) / 4) * 4;
constexpr uint SLOTS = DEPTH + 1;
threadgroup uint4 ring[SLOTS * NB * 128];
const uint warp = threadgroup_position_in_grid.x * 4 + simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup, tid = simdgroup_index_in_threadgroup * 32 + lane;
uint acc = 0;
// super-chunk S of block group ITEM into ring slot S % SLOTS (none past the row's end), one group
#define PROBE_COPY(ITEM, S)                                                                            \
  if ((S) < SUPERS) {                                                                                  \
    LATHE_UNROLL for (uint j_ = 0; j_ < NB; ++j_) {                                                    \
      const uint block_ = (ITEM) * NB + j_;                                                            \
      const uint word_ = ORDER == 0 ? (8 * block_ + lane / 4) * CHUNKS_K + 4 * (S) + lane % 4          \
                       : ORDER == 1 ? (8 * block_ + (S) % 8) * CHUNKS_K + ((S) / 8) * 32 + lane        \
                                    : 8 * block_ * CHUNKS_K + 32 * (S) + lane;                         \
      async_copy_wide(&ring[(((S) % SLOTS) * NB + j_) * 128 + tid], w, word_);                         \
    }                                                                                                  \
  }                                                                                                    \
  async_commit();
for (uint item = warp; item < ITEMS; item += WARPS) {
  LATHE_UNROLL for (uint s = 0; s < DEPTH; ++s) {
    PROBE_COPY(item, s)
  }
  for (uint s = 0; s < SUPERS; ++s) {
    async_wait<DEPTH - 1>();  // super-chunk s is in (this lane's own copies)
    LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
      const uint4 v = ring[((s % SLOTS) * NB + j) * 128 + tid];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // super-chunk s - 1's reads before its slot's refill
    PROBE_COPY(item, s + DEPTH)  // into super-chunk s - 1's slot
  }
}
#undef PROBE_COPY
out[warp * 32 + lane] = acc;
