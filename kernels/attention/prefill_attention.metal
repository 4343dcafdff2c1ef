// Prefill attention, tiled: the T query tokens of a prompt, at positions pos .. pos+T-1, against
// a cache that already holds their K and V (fp16), causal (token i sees keys 0 .. pos+i), fp32
// softmax and sums. FlashAttention-2's schedule on Metal's 8x8 SIMD-group matrices: threadgroup
// (x, hq) takes BQ query rows of query head hq (the heaviest rows first: x counts down) and walks
// its kv head's keys in tiles of BK, which all threads copy into threadgroup memory (two stages:
// tile j+1 travels while tile j is used). Each of the NSIMD SIMD groups owns RB blocks of 8 rows,
// keeps their Q, output sums and running max/sum in registers, and per tile
//   S = Q K^T (K loaded transposed: the B operand as it lies), masked past each row's position;
//   (products in pairs of k blocks, and of row blocks where RB is even: lathe.h's sg8x8_mma_k16*,
//   one tensor-core op each on CUDA)
//   the online softmax on S's thread elements (a row lives in 4 lanes: sg8x8_row_max/sum);
//   O = O * alpha + P V (P in fp16, as FlashAttention does).
// The cache layout is a switch (LATHE_PAGED, set by the prelude):
//  0  contiguous, head-major k/v_cache[1, Hkv, S, D];
//  1  paged as vLLM: k_cache[blocks, Hkv, D/8, BS, 8], v_cache[blocks, Hkv, D, BS], key t in block
//     table[t / BS] at offset t % BS. Its V tile is kept as [D][keys] (8 keys of a dimension are
//     one 16-byte word) and loaded transposed.
// Keys past the last row's position are never loaded: their S is masked, their V zeroed (0 * NaN
// would spoil a sum; unused cache slots may hold anything).
// Constants: D, RB, BK, NSIMD, BS (paged block size; 0 contiguous).
// Inputs: q[T, Hq, D], k_cache, v_cache, table (int32[MAXB]; paged), dims (int32: Hkv, S or MAXB,
//   T, pos, Hq, query tiles), scale (float[1]), after (ordering token, not read). Output:
//   out[T, Hq, D] (fp16).
constexpr uint NT = NSIMD * 32;
constexpr uint BQ = NSIMD * RB * 8;  // query rows a threadgroup
constexpr uint DB = D / 8;           // 8-wide blocks of a head
constexpr uint KB = BK / 8;          // 8-key blocks of a tile
// Threadgroup rows are 16 bytes longer than the data: the 8 rows an 8x8 load touches then fall in
// distinct banks.
constexpr uint KST = D + 8;                        // K (and Q, contiguous V) row stride, halves
constexpr uint VST = LATHE_PAGED ? BK + 8 : D + 8; // V row stride: paged V rows are dimensions
constexpr uint VROWS = LATHE_PAGED ? D : BK;
constexpr uint STAGE = BK * KST + VROWS * VST;     // one tile of K and V, halves
constexpr uint QSIZE = BQ * KST;                   // Q's staging, in stage 1 before the loop
constexpr uint TG_HALVES = STAGE + (STAGE > QSIZE ? STAGE : QSIZE);
static_assert(DB % 2 == 0 && KB % 2 == 0 && TG_HALVES % 8 == 0, "prefill_attention: k blocks go in pairs");
static_assert(TG_HALVES * 2 <= 48 * 1024, "prefill_attention: threadgroup memory over 48 KiB");
const float NEG_INF = -as_type<float>(0x7f800000u);
const float LOG2E = 1.4426950408889634f;

threadgroup uint4 kv_words[TG_HALVES / 8];  // 16-byte aligned, for the 16-byte copies
const auto kv_s = threadgroup_view<half>(kv_words);

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint n_kv = uint(dims[0]);
const uint rows = uint(dims[1]);  // S (contiguous) or MAXB (paged)
const uint n_tok = uint(dims[2]);
const uint pos = uint(dims[3]);
const uint n_heads = uint(dims[4]);
const uint hq = threadgroup_position_in_grid.y;
const uint h = hq / (n_heads / n_kv);
const uint q0 = (uint(dims[5]) - 1 - threadgroup_position_in_grid.x) * BQ;
const uint kv_end = pos + min(q0 + BQ, n_tok);  // keys the tile's last row sees
const uint n_tiles = (kv_end + BK - 1) / BK;
// LATHE_WINDOW W > 0 (a sliding-window layer, Gemma's): a row at position p sees keys p - W + 1 .. p
// only; the tiles start at the one holding the first key the tile's first row sees. A row may then
// meet a tile with no key it sees: its running max stays -inf, and m_safe keeps exp finite.
#ifndef LATHE_WINDOW
#define LATHE_WINDOW 0
#endif
const uint first_seen = LATHE_WINDOW > 0 && pos + q0 + 1 > uint(LATHE_WINDOW) ? pos + q0 + 1 - uint(LATHE_WINDOW) : 0u;
const uint j_first = first_seen / BK;  // tiles alternate stages from here (stage 0 first)
#define SEES(key, p) ((key) <= (p) && (LATHE_WINDOW == 0 || (key) + uint(LATHE_WINDOW) > (p)))
// LATHE_SOFTCAP c > 0 (Gemma 2): a score s (scaled) becomes c * tanh(s / c) before the mask (kept in
// exp2's units: times log2(e) after the cap). 0: none.
#ifndef LATHE_SOFTCAP
#define LATHE_SOFTCAP 0
#endif
#define LOG2_SCORE(s) (LATHE_SOFTCAP > 0 ? float(LATHE_SOFTCAP) * tanh((s) * scale[0] / float(LATHE_SOFTCAP)) * LOG2E \
                                         : (s) * scale_log2)
const float scale_log2 = scale[0] * LOG2E;

// Tile j's K and V into stage j % 2 (asynchronous where a whole 16-byte word is wanted).
#if LATHE_PAGED
#define ISSUE_TILE(j_)                                                                           \
  {                                                                                              \
    const uint k0_ = (j_) * BK;                                                                  \
    auto st_ = kv_s + (((j_) - j_first) & 1u) * STAGE;                                          \
    for (uint e = tid; e < BK * DB; e += NT) {                                                   \
      const uint kk = e / DB, d8 = e % DB, key = k0_ + kk;                                       \
      if (key < kv_end) {                                                                        \
        const uint blk = uint(table[key / BS]);                                                  \
        async_copy_wide(threadgroup_view<uint4>(st_ + kk * KST + d8 * 8), k_cache,               \
                        ((blk * n_kv + h) * DB + d8) * BS + key % BS);                           \
      }                                                                                          \
    }                                                                                            \
    for (uint e = tid; e < D * KB; e += NT) {                                                    \
      const uint d = e / KB, k8 = e % KB, key = k0_ + k8 * 8;                                    \
      auto dst = st_ + BK * KST + d * VST + k8 * 8;                                 \
      if (key + 8 <= kv_end) {                                                                   \
        const uint blk = uint(table[key / BS]);                                                  \
        async_copy_wide(threadgroup_view<uint4>(dst), v_cache, (((blk * n_kv + h) * D + d) * BS + key % BS) / 8); \
      } else {                                                                                   \
        const uint blk = key < kv_end ? uint(table[key / BS]) : 0u;                             \
        for (uint i = 0; i < 8; ++i)                                                             \
          dst[i] = key + i < kv_end ? v_cache[((blk * n_kv + h) * D + d) * BS + key % BS + i] : half(0.0f); \
      }                                                                                          \
    }                                                                                            \
  }
#else
#define ISSUE_TILE(j_)                                                                           \
  {                                                                                              \
    const uint k0_ = (j_) * BK;                                                                  \
    auto st_ = kv_s + (((j_) - j_first) & 1u) * STAGE;                                          \
    for (uint e = tid; e < BK * DB; e += NT) {                                                   \
      const uint kk = e / DB, d8 = e % DB, key = k0_ + kk;                                       \
      const uint src = (h * rows + key) * DB + d8;                                               \
      auto vdst = st_ + BK * KST + kk * VST + d8 * 8;                               \
      if (key < kv_end) {                                                                        \
        async_copy_wide(threadgroup_view<uint4>(st_ + kk * KST + d8 * 8), k_cache, src);         \
        async_copy_wide(threadgroup_view<uint4>(vdst), v_cache, src);                            \
      } else {                                                                                   \
        for (uint i = 0; i < 8; ++i) vdst[i] = half(0.0f);                                       \
      }                                                                                          \
    }                                                                                            \
  }
#endif

// Q's rows into stage 1's space (rows past the prompt repeat its last token: computed, not
// written), then into registers.
{
  auto qs = kv_s + STAGE;
  for (uint e = tid; e < BQ * DB; e += NT) {
    const uint row = e / DB, d8 = e % DB, t = min(q0 + row, n_tok - 1);
    store_wide<uint4>(qs, row * (KST / 8) + d8, load_wide<uint4>(q, (t * n_heads + hq) * DB + d8));
  }
}
ISSUE_TILE(j_first);
async_commit();
threadgroup_barrier(mem_flags::mem_threadgroup);

const uint r = sg8x8_row(lane), c = sg8x8_col(lane);
simdgroup_half8x8 qf[RB][DB];
simdgroup_float8x8 o[RB][DB];
float m_run[RB], l_run[RB];
uint qpos[RB];  // this lane's row's position (the prompt's last one for rows past it)
LATHE_UNROLL
for (uint rb = 0; rb < RB; ++rb) {
  const uint row = (simd * RB + rb) * 8;
  LATHE_UNROLL
  for (uint d = 0; d < DB; ++d) {
    simdgroup_load(qf[rb][d], kv_s + STAGE + row * KST + d * 8, KST);
    o[rb][d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  m_run[rb] = NEG_INF;
  l_run[rb] = 0.0f;
  qpos[rb] = pos + min(q0 + row + r, n_tok - 1);
}

for (uint j = j_first; j < n_tiles; ++j) {
  async_wait<0>();
  threadgroup_barrier(mem_flags::mem_threadgroup);  // tile j is in; tile j-1 (and Q) is done with
  if (j + 1 < n_tiles) ISSUE_TILE(j + 1);
  async_commit();
  const auto ks = kv_s + ((j - j_first) & 1u) * STAGE;
  const auto vs = ks + BK * KST;

  simdgroup_float8x8 s[RB][KB];
  LATHE_UNROLL
  for (uint rb = 0; rb < RB; ++rb) {
    LATHE_UNROLL
    for (uint kb = 0; kb < KB; ++kb) s[rb][kb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  LATHE_UNROLL
  for (uint d = 0; d < DB; d += 2) {
    LATHE_UNROLL
    for (uint kb = 0; kb < KB; ++kb) {
      simdgroup_half8x8 kt0, kt1;  // K^T's blocks (dimensions d*8.. and d*8+8.., keys kb*8..)
      simdgroup_load(kt0, ks + kb * 8 * KST + d * 8, KST, 0, true);
      simdgroup_load(kt1, ks + kb * 8 * KST + d * 8 + 8, KST, 0, true);
      LATHE_UNROLL
      for (uint rb = 0; rb + 1 < RB; rb += 2)
        sg8x8_mma_k16x2(s[rb][kb], s[rb + 1][kb], qf[rb][d], qf[rb][d + 1], qf[rb + 1][d], qf[rb + 1][d + 1], kt0, kt1);
      if (RB % 2) sg8x8_mma_k16(s[RB - 1][kb], qf[RB - 1][d], qf[RB - 1][d + 1], kt0, kt1);
    }
  }

  simdgroup_half8x8 p[RB][KB];
  LATHE_UNROLL
  for (uint rb = 0; rb < RB; ++rb) {
    float row_max = NEG_INF;
    float2 x[KB];
    LATHE_UNROLL
    for (uint kb = 0; kb < KB; ++kb) {
      x[kb] = s[rb][kb].thread_elements();
      const uint key = j * BK + kb * 8 + c;
      x[kb].x = SEES(key, qpos[rb]) ? LOG2_SCORE(x[kb].x) : NEG_INF;
      x[kb].y = SEES(key + 1, qpos[rb]) ? LOG2_SCORE(x[kb].y) : NEG_INF;
      row_max = max(row_max, max(x[kb].x, x[kb].y));
    }
    // Tile 0 holds key 0, which every row sees: the running max is finite from there on (with a
    // window, a row may see nothing yet: m_safe).
    const float m_new = max(m_run[rb], sg8x8_row_max(row_max));
    const float m_safe = LATHE_WINDOW > 0 && m_new == NEG_INF ? 0.0f : m_new;
    const float alpha = exp2(m_run[rb] - m_safe);
    float row_sum = 0.0f;
    LATHE_UNROLL
    for (uint kb = 0; kb < KB; ++kb) {
      const float p0 = exp2(x[kb].x - m_safe), p1 = exp2(x[kb].y - m_safe);
      row_sum += p0 + p1;
      p[rb][kb] = make_filled_simdgroup_matrix<half, 8, 8>(half(0.0f));
      p[rb][kb].thread_elements() = half2(half(p0), half(p1));
    }
    l_run[rb] = l_run[rb] * alpha + sg8x8_row_sum(row_sum);
    m_run[rb] = m_new;
    LATHE_UNROLL
    for (uint d = 0; d < DB; ++d) {
      float2 e = o[rb][d].thread_elements();
      e.x *= alpha;
      e.y *= alpha;
      o[rb][d].thread_elements() = e;
    }
  }

  LATHE_UNROLL
  for (uint d = 0; d < DB; ++d) {
    LATHE_UNROLL
    for (uint kb = 0; kb < KB; kb += 2) {
      simdgroup_half8x8 v0, v1;  // V's blocks (keys kb*8.. and kb*8+8.., dimensions d*8..)
#if LATHE_PAGED
      simdgroup_load(v0, vs + d * 8 * VST + kb * 8, VST, 0, true);
      simdgroup_load(v1, vs + d * 8 * VST + kb * 8 + 8, VST, 0, true);
#else
      simdgroup_load(v0, vs + kb * 8 * VST + d * 8, VST);
      simdgroup_load(v1, vs + (kb + 1) * 8 * VST + d * 8, VST);
#endif
      LATHE_UNROLL
      for (uint rb = 0; rb + 1 < RB; rb += 2)
        sg8x8_mma_k16x2(o[rb][d], o[rb + 1][d], p[rb][kb], p[rb][kb + 1], p[rb + 1][kb], p[rb + 1][kb + 1], v0, v1);
      if (RB % 2) sg8x8_mma_k16(o[RB - 1][d], p[RB - 1][kb], p[RB - 1][kb + 1], v0, v1);
    }
  }
}

LATHE_UNROLL
for (uint rb = 0; rb < RB; ++rb) {
  const uint t = q0 + (simd * RB + rb) * 8 + r;
  const float inv = 1.0f / l_run[rb];
  if (t < n_tok) {
    LATHE_UNROLL
    for (uint d = 0; d < DB; ++d) {
      const float2 e = o[rb][d].thread_elements();
      store_wide<half2>(out, ((t * n_heads + hq) * D + d * 8 + c) / 2, half2(half(e.x * inv), half(e.y * inv)));
    }
  }
}
