// The declarations of decode attention (decode_attention.metal has the design): constants,
// the V-load macros and threadgroup memory. Included once at the top of a kernel body, after
// NT, tid, lane and simd; decode_rows.metal then serves one (partition, head group, sequence).
#ifndef LATHE_HEAD_NORM
#define LATHE_HEAD_NORM 0
#endif
constexpr uint CH = NT;        // tokens a chunk: a thread a token
constexpr uint DV = D / 8;     // 16-byte vectors of a K row
constexpr uint KG = DV % 8 == 0 ? 8 : DV % 6 == 0 ? 6 : DV;  // 16-byte K loads in flight a thread (a
                                                              // factor of DV: 6 for Phi-3's D = 96)
constexpr uint ROWS = D / 32;  // V rows (output dimensions) a lane owns:
// The paged V block is [D, BS] (a dimension's tokens contiguous): lane l owns d = l + 32 i and
// reads 8 tokens of one dimension in a 16-byte load. The contiguous V is [S, D] (a token's row
// contiguous): lane l owns the ROWS neighbours d = ROWS l + i, read as ROWS / 2 half2 words, so a
// SIMD group reads a row whole; where ROWS is odd (D = 96) they would not be 4-byte aligned, and
// lane l owns d = l + 32 i as in the paged layout, a half a load (V_PAIRS false).
constexpr bool V_PAIRS = LATHE_PAGED || ROWS % 2 == 0;
constexpr uint V_WORDS = V_PAIRS ? ROWS / 2 : ROWS;  // contiguous V: a lane's words of a token
#define lane_dim(l, i) (LATHE_PAGED || !V_PAIRS ? (l) + 32 * (i) : (l) * ROWS + (i))
// P.V's 8-token vectors: VPS a SIMD group takes of a chunk, VPF of them loaded at a time (their V
// words in registers: by default all VPS where D <= 128, one at a time for D = 256). An includer
// may set VPF by defining LATHE_V_PREFETCH (decode_attention.metal: the attn_v_prefetch option):
// fewer V words in flight for fewer registers, so that more threadgroups fit an SM.
constexpr uint VPS = CH / 8 / NSIMD;
#ifdef LATHE_V_PREFETCH
constexpr uint VPF = LATHE_V_PREFETCH;
#else
constexpr uint VPF = D <= 128 ? VPS : 1;
#endif
static_assert(VPS % VPF == 0, "decode attention: VPF must be a factor of VPS");
// Slots of threadgroup memory K goes through (decode_rows.metal), a round of KG 16-byte vectors
// for each of the NT threads a slot: 0 (K loaded into registers, as the blocks of kernels/blocks
// do where their threadgroup memory has no room), 1, or 2 (the next round's copies in flight
// during this one's products). An includer may set it (decode_attention.metal: the attn_k_slots
// option; layer_block.metal: block_k_slots).
#ifdef LATHE_K_SLOTS
constexpr uint K_SLOTS = LATHE_K_SLOTS;
#else
constexpr uint K_SLOTS = 0;
#endif
constexpr uint K_SLOT_MOD = K_SLOTS > 0 ? K_SLOTS : 1;  // (a divisor where K_SLOTS is 0 and unused)
// Scores and P.V on SIMD-group matrices (8x8, tensor cores on CUDA) where an includer sets
// LATHE_MMA to 1 (decode_attention.metal: the attn_mma option). Scores: a SIMD group takes the 32
// tokens its lanes copied, S^T = K Q^T with K's fragments from the slot and Q^T's from qh_s (fp16,
// the G heads padded to 8 rows). P.V: O [8 heads x D] += P V with P from p_s (fp16 in the product)
// and V from registers; SIMD group `simd` takes 32 dimensions (MMA_DG: D / 32 groups) of the
// chunk's tokens of its token group (MMA_TG: NSIMD / MMA_DG groups, their sums added at the
// end). The G heads' FMAs a token were the longest link of a threadgroup's chain at G = 4
// (kernels/attention/NOTES.md). Needs K_SLOTS > 0, G <= 8, D 32 .. 128 a multiple of 32 (the
// host's use_mma).
#ifdef LATHE_MMA
constexpr bool USE_MMA = LATHE_MMA;
#else
constexpr bool USE_MMA = false;
#endif
static_assert(!USE_MMA || (K_SLOTS > 0 && G <= 8 && D % 32 == 0 && D <= 32 * NSIMD),
              "decode attention: MMA needs K slots, G <= 8, D a multiple of 32 up to 32 NSIMD");
constexpr uint QST = D + 8;  // qh_s's row stride (halves): the 8 rows of a transposed load in distinct banks
constexpr uint MMA_DG = D >= 32 ? D / 32 : 1;  // SIMD groups across D, 32 dimensions each
constexpr uint MMA_TG = NSIMD >= MMA_DG ? NSIMD / MMA_DG : 1;  // ... and across the chunk's tokens
constexpr uint MMA_TOKENS = CH / MMA_TG;       // tokens a SIMD group's P.V takes
constexpr uint VM = MMA_TOKENS / 8;            // its V: 16-byte words a lane
constexpr uint VM_FIRST = VM * VPF / VPS;      // ... loaded at the chunk's start (VPF of VPS, as V's
                                               // vectors), the rest once its scores are in
// V's words (USE_MMA), as simdgroup_matrix thread elements: lane (row r, column c) of a fragment
// loads, for the SIMD group's dimensions 32 dg .. (dg = simd % MMA_DG) and 8-token blocks b of its
// tokens (from MMA_TOKENS (simd / MMA_DG)),
//  contiguous: token 8 b + r, dimensions 32 dg + 8 (c / 2) .. + 7: vm[b]. Its word w is V's
//    fragment (b, w): tokens 8 b + k (MMA_TOKEN), "virtual" dimensions k = 32 dg + 8 (k / 2) +
//    2 w + k % 2 (MMA_DIM);
//  paged: dimension 32 dg + 8 w + r, tokens 32 g + 8 (c / 2) .. + 7: vm[4 g + w]. Its word x is
//    V's fragment (b = 4 g + x, w), taken by column pairs (sg8x8_from_col_pairs): "virtual"
//    tokens k = 32 g + 8 (k / 2) + 2 x + k % 2 (MMA_TOKEN), dimensions 32 dg + 8 w + k (MMA_DIM).
// P's fragment b (the A operand) takes the same tokens. Tokens past the partition are zero
// (contiguous: not loaded; paged: not loaded, or masked in a word where they are used).
#if LATHE_PAGED
#define MMA_TOKEN(b, k) (32 * ((b) / 4) + 8 * ((k) / 2) + 2 * ((b) % 4) + (k) % 2)
#define MMA_DIM(w, k) (32 * (simd % MMA_DG) + 8 * (w) + (k))
#define LOAD_V_MMA(i0, n)                                                                       \
  LATHE_UNROLL                                                                                  \
  for (uint i = (i0); i < (i0) + (n); ++i) {                                                    \
    const uint t_ = mma_t0 + 32 * (i / 4) + 4 * mma_c;                                          \
    const uint v0_ = t_ < t_end ? (uint(table[cb * rows + t_ / BS]) * n_kv + h) * D * BS + t_ % BS : 0u; \
    vm[i] = t_ < t_end ? load_wide<uint4>(v_cache, (v0_ + MMA_DIM(i % 4, mma_r) * BS) / 8) : zero4; \
  }
#else
#define MMA_TOKEN(b, k) (8 * (b) + (k))
#define MMA_DIM(w, k) (32 * (simd % MMA_DG) + 8 * ((k) / 2) + 2 * (w) + (k) % 2)
#define LOAD_V_MMA(i0, n)                                                                       \
  LATHE_UNROLL                                                                                  \
  for (uint i = (i0); i < (i0) + (n); ++i) {                                                    \
    const uint t_ = mma_t0 + 8 * i + mma_r;                                                     \
    const uint v0_ = ((cb * n_kv + h) * rows + t_) * D + MMA_DIM(0, mma_c);                     \
    vm[i] = t_ < t_end ? load_wide<uint4>(v_cache, v0_ / 8) : zero4;                            \
  }
#endif
// The V words of vectors k0 .. k0 + VPF - 1 of this SIMD group into vw (none past the chunk's
// tokens; the contiguous layout's rows past the context are not loaded either). Paged, with
// LATHE_V_STRAIGHT (the blocks' block_v_straight option): a vector past the chunk loads the
// chunk's first one instead, unused (P.V skips it), so the loads are one straight run. Behind a
// branch each, ptxas gave the paged token_block 181 registers against 128 (Qwen3-0.6B, sm_90);
// the paged decode kernel goes the other way (122 against 132), so it keeps the branches.
#ifndef LATHE_V_STRAIGHT
#define LATHE_V_STRAIGHT 0
#endif
#if LATHE_PAGED
#define LOAD_V_GROUP(k0)                                                                        \
  LATHE_UNROLL                                                                                  \
  for (uint k = 0; k < VPF; ++k) {                                                              \
    const uint vi_ = simd + ((k0) + k) * NSIMD;                                                 \
    if (LATHE_V_STRAIGHT || vi_ * 8 < cn) {                                                     \
      const uint t0_ = vi_ * 8 < cn ? c0 + vi_ * 8 : c0;                                        \
      const uint v0_ = (uint(table[cb * rows + t0_ / BS]) * n_kv + h) * D * BS + t0_ % BS;      \
      LATHE_UNROLL                                                                              \
      for (uint i = 0; i < ROWS; ++i) vw[k][i] = load_wide<uint4>(v_cache, (v0_ + lane_dim(lane, i) * BS) / 8); \
    }                                                                                           \
  }
#else
#define LOAD_V_GROUP(k0)                                                                        \
  LATHE_UNROLL                                                                                  \
  for (uint k = 0; k < VPF; ++k) {                                                              \
    const uint vi_ = simd + ((k0) + k) * NSIMD;                                                 \
    const uint t0_ = c0 + vi_ * 8;                                                              \
    const uint valid_ = vi_ * 8 < cn ? min(8u, t_end - t0_) : 0u;                               \
    const uint v0_ = ((cb * n_kv + h) * rows + t0_) * D;                                        \
    LATHE_UNROLL                                                                                \
    for (uint j = 0; j < 8; ++j) {                                                              \
      LATHE_UNROLL                                                                              \
      for (uint w = 0; w < V_WORDS; ++w) {                                                      \
        vw[k][j][w] = j >= valid_ ? 0u                                                          \
                      : V_PAIRS ? load_wide<uint>(v_cache, (v0_ + j * D + lane_dim(lane, 2 * w)) / 2) \
                                : uint(load_wide<ushort>(v_cache, v0_ + j * D + lane_dim(lane, w))); \
      }                                                                                         \
    }                                                                                           \
  }
#endif
// K_ROW(t): the first value of token t's K row; K_AT(k_row, c): its 16-byte vector c, an index of
// k_cache seen as uint4 (the paged K block is [D/8, BS, 8], the contiguous [S, D]).
#if LATHE_PAGED
#define K_ROW(t) ((uint(table[cb * rows + (t) / BS]) * n_kv + h) * DV * BS + (t) % BS) * 8
#define K_AT(k_row, c) (((k_row) + (c) * BS * 8) / 8)
#else
#define K_ROW(t) ((cb * n_kv + h) * rows + (t)) * D
#define K_AT(k_row, c) (((k_row) + (c) * 8) / 8)
#endif
// K_SLOTS > 0: round r (vectors r KG .. r KG + KG - 1) of the chunk at c0_ into the next slot
// (cp.async), as one group of copies. Every thread commits a group, with copies or none, so that
// the groups' count is the threadgroup's (async_wait). Each thread copies its own token's vectors
// (slot layout [vector][token]): the paged block's vectors of a round are a warp's 512 contiguous
// bytes (a lane a token); the contiguous layout gives a lane a row of its own, its neighbouring
// vectors two halves of one 32-byte sector: those go through the L1, which asks the L2 for the
// sector once. K_BY_ROW (LATHE_K_ROWS, the attn_k_copy option; the MMA form over the contiguous
// layout, where a SIMD group reads back only its own 32 tokens): KG lanes take one token's round,
// 32 / KG tokens' whole rows an instruction, into [token][vector] with vector c of token t at
// c ^ (t % KG), so that both the copies and an 8-token fragment's reads fall in distinct banks.
#ifdef LATHE_K_ROWS
constexpr bool K_BY_ROW = USE_MMA && !LATHE_PAGED && LATHE_K_ROWS;
#else
constexpr bool K_BY_ROW = false;
#endif
#define K_SLOT_AT(t, c) (K_BY_ROW ? (t) * KG + ((c) ^ ((t) % KG)) : (c) * NT + (t))  // a uint4 of a slot
#if LATHE_PAGED
#define K_ASYNC_COPY async_copy_wide
#else
#define K_ASYNC_COPY async_copy_wide_l1
#endif
// LATHE_K_EARLY (the blocks' block_k_early option): the threadgroup that writes the query's new
// row (decode_rows.metal, LATHE_ROPE) still copies the chunk's first round before it has the
// query, and before the includer's wait (LATHE_BEFORE_QUERY): K_COPY_'s SKIP leaves the new row
// out of those copies, and K_FILL_NEW puts its vectors in the slot from threadgroup memory (sum_s,
// free until the chunks are done) once they are rotated, by the thread that reads them back (the
// MMA form: lanes of the token's SIMD group). The rounds after it copy the row from the cache, as
// written before the query's barrier. Only the first: in the chunk loop a fill took Qwen3-0.6B's
// token block from 128 registers to 134 (NVRTC sm_90: 3 threadgroups an SM against 4).
#ifndef LATHE_K_EARLY
#define LATHE_K_EARLY 0
#endif
#define K_FILL_NEW(c0_, r_, slot_)                                                              \
  if (k_new - (c0_) < min(CH, t_end - (c0_))) {                                                 \
    const uint tn_ = k_new - (c0_);                                                             \
    LATHE_UNROLL                                                                                \
    for (uint c = 0; c < KG; ++c) {                                                             \
      if (USE_MMA ? simd == tn_ / 32 && lane == c : tid == tn_) {                               \
        const uint v_ = 8 * ((r_) * KG + c);                                                    \
        k_s[(slot_) + K_SLOT_AT(tn_, c)] = uint4{                                               \
            as_type<uint>(half2(half(sum_s[v_]), half(sum_s[v_ + 1]))),                         \
            as_type<uint>(half2(half(sum_s[v_ + 2]), half(sum_s[v_ + 3]))),                     \
            as_type<uint>(half2(half(sum_s[v_ + 4]), half(sum_s[v_ + 5]))),                     \
            as_type<uint>(half2(half(sum_s[v_ + 6]), half(sum_s[v_ + 7])))};                    \
      }                                                                                         \
    }                                                                                           \
  }
#define K_COPY(c0_, r_) K_COPY_(c0_, r_, false)
#define K_COPY_(c0_, r_, SKIP)                                                                  \
  {                                                                                             \
    const uint slot_ = (k_issued % K_SLOT_MOD) * KG * NT;                                       \
    const uint n_ = min(CH, t_end - (c0_));                                                     \
    if (K_BY_ROW) {  /* (one address a lane, the rows at fixed offsets from it) */            \
      const auto src_ = k_cache + K_ROW((c0_) + 32 * simd + lane / KG) + ((r_) * KG + lane % KG) * 8; \
      LATHE_UNROLL                                                                              \
      for (uint i = 0; i < KG; ++i) {                                                           \
        const uint t_ = 32 * simd + i * (32 / KG) + lane / KG;                                  \
        if (t_ < n_ && (!(SKIP) || (c0_) + t_ != k_new))                                        \
          async_copy_wide(&k_s[slot_ + K_SLOT_AT(t_, lane % KG)], src_, i * (32 / KG) * D / 8); \
      }                                                                                         \
    } else if (tid < n_ && (!(SKIP) || (c0_) + tid != k_new)) {                                 \
      const uint k_row_ = K_ROW((c0_) + tid);                                                   \
      LATHE_UNROLL                                                                              \
      for (uint c = 0; c < KG; ++c) K_ASYNC_COPY(&k_s[slot_ + K_SLOT_AT(tid, c)], k_cache, K_AT(k_row_, (r_) * KG + c)); \
    }                                                                                           \
    async_commit();                                                                             \
    ++k_issued;                                                                                 \
  }
const float NEG_INF = -as_type<float>(0x7f800000u);  // -inf

threadgroup float q_s[G * D];
threadgroup float p_s[G * CH];
threadgroup float m_s[G];
threadgroup float l_s[G];
threadgroup float alpha_s[G];
threadgroup float sum_s[G * D];
// K's slots (K_SLOTS: 0, 1 or 2), K_SLOT_AT's layout. LATHE_K_SLOTS_HOST, where an includer
// defines it: a threadgroup array of its own that holds them instead where LATHE_K_SLOTS_IN is
// true (layer_block.metal: the GEMV phases' staged X', which no attention ticket reads).
#ifdef LATHE_K_SLOTS_HOST
threadgroup uint4 k_own[LATHE_K_SLOTS_IN ? 1 : K_SLOTS * KG * NT + 1];
const auto k_s = LATHE_K_SLOTS_IN ? threadgroup_view<uint4>(LATHE_K_SLOTS_HOST)
                                   : threadgroup_view<uint4>(k_own);
#else
threadgroup uint4 k_s[K_SLOTS * KG * NT + 1];
#endif
threadgroup half qh_s[USE_MMA ? 8 * QST : 1];  // USE_MMA: the G query heads (scaled, fp16), rows G..7 zero
#if LATHE_HEAD_NORM
threadgroup float norm_s[G + 1];  // 1 / RMS of the G query heads and of the kv head's K
#endif
#if LATHE_SPLIT && LATHE_MERGE
constexpr uint MERGE_PARTS = 32 * MLANE;  // partitions the in-launch merge takes at most
threadgroup uint merge_here;      // this threadgroup was its head group's last: it merges
threadgroup float w_s[G * MERGE_PARTS];  // each partition's weight in the merged output
#endif
