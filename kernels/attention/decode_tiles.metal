// The declarations of decode attention (decode_attention.metal has the design): constants,
// the V-load macros and threadgroup memory. Included once at the top of a kernel body, after
// NT, tid, lane and simd; decode_rows.metal then serves one (partition, head group, sequence).
#ifndef LATHE_HEAD_NORM
#define LATHE_HEAD_NORM 0
#endif
constexpr uint CH = NT;        // tokens a chunk: a thread a token
constexpr uint KG = D / 8 < 8 ? D / 8 : 8;  // 16-byte K loads in flight a thread
constexpr uint DV = D / 8;     // 16-byte vectors of a K row
constexpr uint ROWS = D / 32;  // V rows (output dimensions) a lane owns:
// The paged V block is [D, BS] (a dimension's tokens contiguous): lane l owns d = l + 32 i and
// reads 8 tokens of one dimension in a 16-byte load. The contiguous V is [S, D] (a token's row
// contiguous): lane l owns the ROWS neighbours d = ROWS l + i, so a SIMD group reads a row whole.
#define lane_dim(l, i) (LATHE_PAGED ? (l) + 32 * (i) : (l) * ROWS + (i))
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
// The V words of vectors k0 .. k0 + VPF - 1 of this SIMD group into vw (none past the chunk's
// tokens; the contiguous layout's rows past the context are not loaded either).
#if LATHE_PAGED
#define LOAD_V_GROUP(k0)                                                                        \
  LATHE_UNROLL                                                                                  \
  for (uint k = 0; k < VPF; ++k) {                                                              \
    const uint vi_ = simd + ((k0) + k) * NSIMD;                                                 \
    if (vi_ * 8 < cn) {                                                                         \
      const uint t0_ = c0 + vi_ * 8;                                                            \
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
      for (uint w = 0; w < ROWS / 2; ++w) {                                                     \
        vw[k][j][w] = j < valid_ ? load_wide<uint>(v_cache, (v0_ + j * D + lane_dim(lane, 2 * w)) / 2) : 0u; \
      }                                                                                         \
    }                                                                                           \
  }
#endif
// L2PF (the attn_l2_prefetch option, through LATHE_L2_PREFETCH; 0 where an includer sets none):
// chunks whose K and V lines are requested into the L2 ahead of their loads. The first L2PF
// chunks are requested before anything else (the query's load, RoPE), then each chunk requests
// the one L2PF ahead as it begins. The requests hold no registers and wait for nothing, so a
// threadgroup has its whole chunk in flight from its first instruction, where its own loads come
// in groups (a K row in D / 8 / KG round trips, V in VPS / VPF): the second and later groups then
// meet the L2, not DRAM, and the next chunk streams in while this one's arithmetic runs.
#ifdef LATHE_L2_PREFETCH
constexpr uint L2PF = LATHE_L2_PREFETCH;
#else
constexpr uint L2PF = 0;
#endif
// PREFETCH_CHUNK(c): the K and V lines of tokens [c, c + CH) (none past t_end), the threadgroup's
// threads taking 128-byte lines in turn.
#if LATHE_PAGED
// A block's K ([D/8, BS, 8]) and V ([D, BS]) of one kv head are each D * BS * 2 contiguous bytes.
#define PREFETCH_CHUNK(c)                                                                         \
  if ((c) < t_end) {                                                                              \
    constexpr uint LPB_ = D * BS * 2 / 128; /* 128-byte lines of a block's K, and of its V */     \
    const uint b0_ = (c) / BS, nb_ = (min((c) + CH, t_end) - 1) / BS - b0_ + 1;                   \
    for (uint i_ = tid; i_ < nb_ * 2 * LPB_; i_ += NT) {                                          \
      const uint r_ = i_ % (2 * LPB_);                                                            \
      const size_t at_ = size_t(uint(table[cb * rows + b0_ + i_ / (2 * LPB_)]) * n_kv + h) * (D * BS * 2) \
                         + (r_ % LPB_) * 128;                                                     \
      if (r_ < LPB_) prefetch_l2(k_cache, at_, 128, 0, 1);                                        \
      else prefetch_l2(v_cache, at_, 128, 0, 1);                                                  \
    }                                                                                             \
  }
#else
// A kv head's rows are contiguous in both caches ([S, D]): one run of bytes each.
#define PREFETCH_CHUNK(c)                                                                         \
  if ((c) < t_end) {                                                                              \
    const size_t at_ = size_t((cb * n_kv + h) * rows + (c)) * (D * 2);                            \
    const size_t n_ = size_t(min(CH, t_end - (c))) * (D * 2);                                     \
    prefetch_l2(k_cache, at_, n_, tid, NT);                                                       \
    prefetch_l2(v_cache, at_, n_, tid, NT);                                                       \
  }
#endif
const float NEG_INF = -as_type<float>(0x7f800000u);  // -inf

threadgroup float q_s[G * D];
threadgroup float p_s[G * CH];
threadgroup float m_s[G];
threadgroup float l_s[G];
threadgroup float alpha_s[G];
threadgroup float sum_s[G * D];
#if LATHE_HEAD_NORM
threadgroup float norm_s[G + 1];  // 1 / RMS of the G query heads and of the kv head's K
#endif
#if LATHE_SPLIT && LATHE_MERGE
constexpr uint MERGE_PARTS = 64;  // partitions the in-launch merge takes at most
threadgroup uint merge_here;      // this threadgroup was its head group's last: it merges
threadgroup float w_s[G * MERGE_PARTS];  // each partition's weight in the merged output
#endif
