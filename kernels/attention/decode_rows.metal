// Decode attention for one threadgroup's work, included inside a scope that names `part`, `hg`
// and `b` (partition, head group, sequence: the launch's grid position in decode_attention.metal,
// a claimed ticket in the blocks of kernels/blocks), the inputs, and decode_tiles.metal's
// declarations. It starts by writing threadgroup memory: an includer that runs it more than once
// puts a threadgroup barrier between the runs.
// LATHE_MARK(i): an includer's stamp of where a ticket is (the blocks' timeline: 0 the query
// ready, 1 the first chunk's scores, 2 the last chunk's P.V); nothing otherwise.
#ifndef LATHE_MARK
#define LATHE_MARK(i)
#endif
const uint h = hg / QS;  // the kv head of query heads hg*G .. hg*G+G-1
const uint n_kv = uint(dims[0]);
const uint rows = uint(dims[1]);  // S (contiguous) or MAXB (paged)
// The cache sequence (and block-table row) of query b: b, or 0 for every query when the queries
// are the tokens of one prompt (prefill: query b sees the cache up to lens[b], its own position).
const uint cb = b * uint(dims[4]);
const uint n_heads = n_kv * QS * G;
// Device lengths (a compiled step) are not checked on the host: clamped to the cache here.
#if LATHE_ROPE
// Query b's new token is at pos[b] (one query: b = 0); its QKV row is LATHE_QKV_ROW values after
// query b - 1's (the blocks' batched token_block; 0 where there is one query).
#ifndef LATHE_QKV_ROW
#define LATHE_QKV_ROW 0u
#endif
const uint q_pos = uint(pos[b]);
const auto qkv_b = qkv + b * (LATHE_QKV_ROW);
const uint ctx = min(q_pos + 1, rows * uint(LATHE_PAGED ? BS : 1));
#else
const uint ctx = min(uint(lens[b]), rows * uint(LATHE_PAGED ? BS : 1));
#endif
// LATHE_WINDOW W > 0 (a sliding-window layer, Gemma's): the query sees its last W positions,
// tokens t_lo .. ctx - 1. The partitions are laid from t_lo rounded down to a vector of 8 (t_from:
// V's vectors and the K copies stay aligned), and the few tokens before t_lo in partition 0's first
// chunk are masked out of the scores; that chunk holds t_lo, so its running max is finite.
#ifndef LATHE_WINDOW
#define LATHE_WINDOW 0
#endif
// LATHE_SOFTCAP c > 0 (Gemma 2): each score s (already scaled) becomes c * tanh(s / c) before the
// mask, as llama.cpp's build_attn softcaps kq. 0: none.
#ifndef LATHE_SOFTCAP
#define LATHE_SOFTCAP 0
#endif
#define SOFTCAPPED(s) (LATHE_SOFTCAP > 0 ? float(LATHE_SOFTCAP) * tanh((s) / float(LATHE_SOFTCAP)) : (s))
const uint t_lo = LATHE_WINDOW > 0 && ctx > uint(LATHE_WINDOW) ? ctx - uint(LATHE_WINDOW) : 0u;
const uint t_from = t_lo & ~7u;
const uint t_begin = LATHE_SPLIT ? min(ctx, t_from + part * uint(dims[2])) : t_from;
const uint t_end = LATHE_SPLIT ? min(ctx, t_begin + uint(dims[2])) : ctx;

// K through threadgroup memory (K_SLOTS > 0, decode_tiles.metal's k_s): each thread copies its own
// token's KG 16-byte vectors a round into a slot with cp.async (async_copy_wide). The copies hold
// no registers, so all of a round's are in flight at once (ptxas spread the register loads of a
// round among their products to stay within 128 registers: three or four DRAM round trips a
// round; kernels/attention/NOTES.md), and with two slots the next round's copies go out before
// this round's products, the next chunk's first round during this chunk's softmax and P.V. The
// first chunk's first round goes out before the query is read, except in the threadgroup that
// writes the new row (LATHE_ROPE), which reads it after the write. A thread reads back only its
// own copies: its async_wait orders them, no barrier (the MMA form: its SIMD group's, after the
// lanes' waits and a SIMD-group barrier).
uint k_issued = 0, k_read = 0;  // rounds copied and rounds scored; a round's slot: its number % K_SLOTS
// LATHE_NEW_ROWS (token_block's prompt form): the queries are one prompt's tokens, each writing
// its own row; this one's rows may be another query's, not yet written: nothing is read before the
// wait below.
#ifndef LATHE_NEW_ROWS
#define LATHE_NEW_ROWS false
#endif
#if LATHE_ROPE
const bool writes_new = q_pos >= t_begin && q_pos < t_end;  // this threadgroup writes the new row
const bool k_early = (!writes_new || LATHE_K_EARLY) && !LATHE_NEW_ROWS;
const uint k_new = LATHE_K_EARLY && writes_new ? q_pos : ~0u;  // (decode_tiles.metal's K_FILL_NEW)
#else
const bool k_early = true;
const uint k_new = ~0u;
#endif
// LATHE_K_EARLY with two slots: both rounds of a 16-vector row go out early (the loop then issues
// the next round only once one is left in flight).
constexpr uint K_EARLY_ROUNDS = LATHE_K_EARLY && K_SLOTS > 1 && DV / KG > 1 ? 2 : 1;
if (K_SLOTS > 0 && k_early && t_begin < t_end) {
  K_COPY_(t_begin, 0, LATHE_K_EARLY);  // (LATHE_K_EARLY: without the new row, filled in below)
  if (K_EARLY_ROUNDS > 1) K_COPY_(t_begin, 1, LATHE_K_EARLY);
}
// LATHE_BEFORE_QUERY: the includer's code between the first copies of K and the first read of
// QKV's row (layer_block.metal with LATHE_K_EARLY: its wait for the QKV phase).
#ifdef LATHE_BEFORE_QUERY
LATHE_BEFORE_QUERY
#endif

#if LATHE_ROPE
{
  // Pair i of a head turns by pos * freq_scale * inv_freq(i) (rope_kv_write.metal's angles).
  const float p = float(q_pos) * rope_scalars[1];
#if LATHE_HEAD_NORM
  // Qwen3's per-head RMSNorm first: 1 / RMS of each of the G query heads (norm_s[g]) and of the
  // kv head's K (norm_s[G]), a SIMD group a head; the weights then scale each pair.
  for (uint r = simd; r <= G; r += NSIMD) {
    const auto src = qkv_b + (r < G ? hg * G + r : n_heads + h) * D;
    float ss = 0.0f;
    for (uint i = lane; i < D; i += 32) ss += float(src[i]) * float(src[i]);
    ss = simd_sum(ss);
    if (lane == 0) norm_s[r] = rsqrt(ss / float(D) + rope_scalars[2]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
#define Q_NORM(g, i) (norm_s[g] * q_norm[i])
#define K_NORM(i) (norm_s[G] * k_norm[i])
#else
#define Q_NORM(g, i) 1.0f
#define K_NORM(i) 1.0f
#endif
  for (uint e = tid; e < G * D / 2; e += NT) {
    const uint g = e / (D / 2), i = e % (D / 2);
    const float angle = p * rope_inv_freq<D, FREQ_TABLE>(inv_freq, i, rope_scalars[0]);
    const float c = cos(angle), sn = sin(angle);
    const uint i0 = rope_first<D, NEOX>(i), i1 = rope_second<D, NEOX>(i);
    const float a = float(qkv_b[(hg * G + g) * D + i0]) * Q_NORM(g, i0);
    const float bq = float(qkv_b[(hg * G + g) * D + i1]) * Q_NORM(g, i1);
    const float q0 = (a * c - bq * sn) * scale[0], q1 = (a * sn + bq * c) * scale[0];
    q_s[g * D + i0] = q0;
    q_s[g * D + i1] = q1;
    if (USE_MMA) {
      qh_s[g * QST + i0] = half(q0);
      qh_s[g * QST + i1] = half(q1);
    }
  }
  const uint row_at = q_pos;
  if (row_at >= t_begin && row_at < t_end) {  // this threadgroup reads the new row: write it first
#if LATHE_PAGED
    // row_at's slot: offset row_at % BS of block table[b, row_at / BS] (K_ROW's and V's layouts)
    const uint slot_block = uint(table[cb * rows + row_at / BS]) * n_kv + h, slot_at = row_at % BS;
    auto k_row = writable(k_cache) + (slot_block * DV * BS + slot_at) * 8;
    auto v_row = writable(v_cache) + slot_block * D * BS + slot_at;
#define K_NEW(i) k_row[((i) / 8) * BS * 8 + (i) % 8]
#define V_NEW(e) v_row[(e) * BS]
#else
    auto k_row = writable(k_cache) + (h * rows + row_at) * D;
    auto v_row = writable(v_cache) + (h * rows + row_at) * D;
#define K_NEW(i) k_row[i]
#define V_NEW(e) v_row[e]
#endif
    const auto k_src = qkv_b + (n_heads + h) * D;
    const auto v_src = qkv_b + (n_heads + n_kv + h) * D;
    for (uint i = tid; i < D / 2; i += NT) {
      const float angle = p * rope_inv_freq<D, FREQ_TABLE>(inv_freq, i, rope_scalars[0]);
      const float c = cos(angle), sn = sin(angle);
      const uint i0 = rope_first<D, NEOX>(i), i1 = rope_second<D, NEOX>(i);
      const float a = float(k_src[i0]) * K_NORM(i0), bk = float(k_src[i1]) * K_NORM(i1);
      const half k0 = half(a * c - bk * sn), k1 = half(a * sn + bk * c);
      K_NEW(i0) = k0;
      K_NEW(i1) = k1;
      if (LATHE_K_EARLY) {  // for K_FILL_NEW: the slots this threadgroup reads take it from here
        sum_s[i0] = float(k0);
        sum_s[i1] = float(k1);
      }
    }
    for (uint e = tid; e < D; e += NT) V_NEW(e) = v_src[e];
#undef K_NEW
#undef V_NEW
  }
#undef Q_NORM
#undef K_NORM
}
#else
for (uint e = tid; e < G * D; e += NT) {
  q_s[e] = float(q[(b * n_heads + hg * G) * D + e]) * scale[0];
  if (USE_MMA) qh_s[(e / D) * QST + e % D] = half(q_s[e]);
}
#endif
if (USE_MMA) {  // Q's rows past the G heads: zero in the products
  for (uint e = tid; e < (8 - G) * QST; e += NT) qh_s[G * QST + e] = half(0.0f);
}
if (tid < G) {
  m_s[tid] = NEG_INF;
  l_s[tid] = 0.0f;
}
float acc[G][ROWS];
for (uint g = 0; g < G; ++g) {
  for (uint i = 0; i < ROWS; ++i) acc[g][i] = 0.0f;
}
// USE_MMA: this SIMD group's sums O [8 heads x its 32 dimensions] (rows G..7 unused), fragment w
// holding columns MMA_DIM(w, k); its lane's fragment row and first column.
simdgroup_float8x8 o_mma[4];
for (uint w = 0; w < 4; ++w) o_mma[w] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
const uint mma_r = sg8x8_row(lane), mma_c = sg8x8_col(lane);
uint4 zero4;
zero4.x = zero4.y = zero4.z = zero4.w = 0u;
// (LATHE_ROPE: the new cache row, written above, is read by other threads of this threadgroup.)
threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
if (LATHE_K_EARLY && K_SLOTS > 0 && k_early && t_begin < t_end) {
  K_FILL_NEW(t_begin, 0, 0u)  // the early rounds' slots: the new row's vectors they left out
  if (K_EARLY_ROUNDS > 1) K_FILL_NEW(t_begin, 1, KG * NT)
}
#if LATHE_ROPE && defined(LATHE_ROWS_COUNTER)
if (LATHE_NEW_ROWS) {
  // count this head group's new row (its partition holds it) on query b's counter, then wait until
  // each query before b has all of its rows counted (LATHE_ROWS_WRITTEN, the includer's count)
  if (tid == 0) {
    if (q_pos >= t_begin && q_pos < t_end) grid_signal(LATHE_ROWS_COUNTER(b));
    for (uint e = 0; e < b; ++e) grid_wait(LATHE_ROWS_COUNTER(e), LATHE_ROWS_WRITTEN);
  }
  threadgroup_barrier(mem_flags::mem_device);
}
#endif
LATHE_MARK(0)
for (uint c0 = t_begin; c0 < t_end; c0 += CH) {
  const uint cn = min(CH, t_end - c0);
  // This SIMD group's V words of its first VPF vectors of the chunk, issued before the K loads:
  // they do not depend on the scores, and P.V then waits on no DRAM round trip of its own.
#if LATHE_PAGED
  uint4 vw[VPF][ROWS];  // vector k, row lane_dim(lane, i): its 8 tokens
#else
  uint vw[VPF][8][V_WORDS];  // vector k, token j: this lane's ROWS values as half2 words (or halves)
#endif
  uint4 vm[VM];  // USE_MMA: this SIMD group's V (decode_tiles.metal's LOAD_V_MMA)
  const uint mma_t0 = c0 + MMA_TOKENS * (simd / MMA_DG);  // its first token of P.V
  if (USE_MMA) {
    LOAD_V_MMA(0, VM_FIRST);
  } else {
    LOAD_V_GROUP(0);
  }
  // Scores of the chunk, a thread a token (CH = NT: no loop here, so that the compiler keeps
  // q_s in threadgroup memory rather than hoisting all G * D values into registers).
  {
    const uint tl = tid;
    float s[G];
    for (uint g = 0; g < G; ++g) s[g] = 0.0f;
    simdgroup_float8x8 st[4];  // USE_MMA: S^T of the SIMD group's 32 tokens, 8 a fragment, 8 heads
    for (uint x = 0; x < 4; ++x) st[x] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    // Rounds of KG 16-byte vectors: copied (K_SLOTS > 0) or loaded together, then their products.
    for (uint r = 0; r < DV / KG; ++r) {
      uint4 kr[KG];
      if (K_SLOTS > 0) {
        if (k_issued == k_read) {  // this round, unless it went out already (early, or a round before)
          K_COPY(c0, r);
        }
        bool next = false;
        if (K_SLOTS > 1 && (K_EARLY_ROUNDS == 1 || k_issued == k_read + 1)) {
          if (r + 1 < DV / KG) {
            K_COPY(c0, r + 1);
            next = true;
          } else if (c0 + CH < t_end) {
            K_COPY(c0 + CH, 0);
            next = true;
          }
        }
        if (next) {
          async_wait<1>();
        } else {
          async_wait<0>();
        }
        const uint at = (k_read % K_SLOT_MOD) * KG * NT + tl;
        if (USE_MMA) {
          // The SIMD group's lanes copied its 32 tokens' rows: their copies, then the products.
          // Lane (row r, column c) of K's fragment (tokens 8 x .., vector v) holds token 8 x + r's
          // dimensions 8 v + c, + 1: word c / 2 of the slot's uint4 K_SLOT_AT(token, v).
          simdgroup_barrier(mem_flags::mem_threadgroup);
          const auto kh = threadgroup_view<half>(k_s) + (at - tl + 32 * simd) * 8;  // [vector][token]
          const auto kw = threadgroup_view<uint>(k_s) + 4 * (at - tl);             // K_BY_ROW
          LATHE_UNROLL
          for (uint c = 0; c < KG; c += 2) {
            simdgroup_half8x8 qt0, qt1;  // Q^T's fragments of vectors r KG + c and + 1
            simdgroup_load(qt0, qh_s + 8 * (r * KG + c), QST, 0, true);
            simdgroup_load(qt1, qh_s + 8 * (r * KG + c + 1), QST, 0, true);
            LATHE_UNROLL
            for (uint x = 0; x < 4; x += 2) {
              simdgroup_half8x8 k00, k01, k10, k11;  // tokens 8 x .. and 8 x + 8 .., vectors c, c + 1
              if (K_BY_ROW) {
                const uint t0 = 32 * simd + 8 * x + mma_r, t1 = t0 + 8;
                k00.thread_elements() = as_type<half2>(kw[4 * K_SLOT_AT(t0, c) + mma_c / 2]);
                k01.thread_elements() = as_type<half2>(kw[4 * K_SLOT_AT(t0, c + 1) + mma_c / 2]);
                k10.thread_elements() = as_type<half2>(kw[4 * K_SLOT_AT(t1, c) + mma_c / 2]);
                k11.thread_elements() = as_type<half2>(kw[4 * K_SLOT_AT(t1, c + 1) + mma_c / 2]);
              } else {  // 8 tokens' vectors 16 bytes apart
                simdgroup_load(k00, kh + (c * NT + 8 * x) * 8, 8);
                simdgroup_load(k01, kh + ((c + 1) * NT + 8 * x) * 8, 8);
                simdgroup_load(k10, kh + (c * NT + 8 * x + 8) * 8, 8);
                simdgroup_load(k11, kh + ((c + 1) * NT + 8 * x + 8) * 8, 8);
              }
              sg8x8_mma_k16x2(st[x], st[x + 1], k00, k01, k10, k11, qt0, qt1);
            }
          }
        } else {
          LATHE_UNROLL
          for (uint c = 0; c < KG; ++c) kr[c] = k_s[at - tl + K_SLOT_AT(tl, c)];
        }
        ++k_read;
      } else if (tl < cn) {
        const uint k_row = K_ROW(c0 + tl);
        LATHE_UNROLL
        for (uint c = 0; c < KG; ++c) kr[c] = load_wide<uint4>(k_cache, K_AT(k_row, r * KG + c));
      }
      if (!USE_MMA && tl < cn) {
        LATHE_UNROLL
        for (uint c = 0; c < KG; ++c) {
          const uint ku[4] = {kr[c].x, kr[c].y, kr[c].z, kr[c].w};
          for (uint j = 0; j < 4; ++j) {
            const half2 k2 = as_type<half2>(ku[j]);
            const float ka = float(k2.x), kb = float(k2.y);
            const uint e = 8 * (r * KG + c) + 2 * j;
            for (uint g = 0; g < G; ++g) {
              s[g] = fma(q_s[g * D + e], ka, s[g]);
              s[g] = fma(q_s[g * D + e + 1], kb, s[g]);
            }
          }
        }
      }
    }
    if (USE_MMA) {  // lane (row r, column c) of fragment x: token 8 x + r, heads c and c + 1
      LOAD_V_MMA(VM_FIRST, VM - VM_FIRST);
      LATHE_UNROLL
      for (uint x = 0; x < 4; ++x) {
        const float2 e = st[x].thread_elements();
        const uint t = 32 * simd + 8 * x + mma_r;
        const bool seen = t < cn && c0 + t >= t_lo;
        if (mma_c < G) p_s[mma_c * CH + t] = seen ? SOFTCAPPED(e.x) : NEG_INF;
        if (mma_c + 1 < G) p_s[(mma_c + 1) * CH + t] = seen ? SOFTCAPPED(e.y) : NEG_INF;
      }
    } else {
      for (uint g = 0; g < G; ++g) p_s[g * CH + tl] = tl < cn && c0 + tl >= t_lo ? SOFTCAPPED(s[g]) : NEG_INF;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c0 == t_begin) {
    LATHE_MARK(1)
  }

  // Online softmax, a SIMD group a query head: new max, rescale factor, exp, running sum.
  for (uint g = simd; g < G; g += NSIMD) {
    float mx = NEG_INF;
    for (uint tl = lane; tl < CH; tl += 32) mx = max(mx, p_s[g * CH + tl]);
    mx = simd_max(mx);
    const float m_new = max(m_s[g], mx);
    float sum = 0.0f;
    for (uint tl = lane; tl < CH; tl += 32) {
      const float p = tl < cn ? exp(p_s[g * CH + tl] - m_new) : 0.0f;
      p_s[g * CH + tl] = p;
      sum += p;
    }
    sum = simd_sum(sum);
    if (lane == 0) {
      const float alpha = exp(m_s[g] - m_new);
      alpha_s[g] = alpha;
      l_s[g] = l_s[g] * alpha + sum;
      m_s[g] = m_new;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // P.V: SIMD groups take 8-token vectors in turn (vector vi = simd + k * NSIMD); lane l owns
  // rows lane_dim(l, i). The V words of VPF vectors are in vw; the first VPF came in with K.
  if (USE_MMA) {
    // O = O * alpha + P V over the SIMD group's tokens and dimensions: P's fragments b (heads x
    // tokens MMA_TOKEN(b, k), fp16) and V's (b, w), two (16 tokens) a product.
    const float alpha = mma_r < G ? alpha_s[mma_r] : 0.0f;
    LATHE_UNROLL
    for (uint w = 0; w < 4; ++w) {
      float2 e = o_mma[w].thread_elements();
      e.x *= alpha;
      e.y *= alpha;
      o_mma[w].thread_elements() = e;
    }
    LATHE_UNROLL
    for (uint b = 0; b < VM; b += 2) {
      simdgroup_half8x8 pf[2], vf[2];
      LATHE_UNROLL
      for (uint y = 0; y < 2; ++y) {
        const uint t = mma_t0 - c0 + MMA_TOKEN(b + y, mma_c);  // and t + 1
        float p0 = 0.0f, p1 = 0.0f;
        if (mma_r < G) {
          p0 = p_s[mma_r * CH + t];
          p1 = p_s[mma_r * CH + t + 1];
        }
        pf[y] = make_filled_simdgroup_matrix<half, 8, 8>(half(0.0f));
        pf[y].thread_elements() = half2(half(p0), half(p1));
      }
      LATHE_UNROLL
      for (uint w = 0; w < 4; ++w) {
        LATHE_UNROLL
        for (uint y = 0; y < 2; ++y) {
#if LATHE_PAGED
          // word x of this lane's 8 tokens 32 g + 8 (c / 2) ..: those past the partition masked
          const uint g = (b + y) / 4, x = (b + y) % 4;
          const uint4 v4 = vm[4 * g + w];
          const uint t8 = mma_t0 + 32 * g + 4 * mma_c;
          const uint n8 = t_end > t8 ? t_end - t8 : 0u;
          uint word = x == 0 ? v4.x : x == 1 ? v4.y : x == 2 ? v4.z : v4.w;
          word = 2 * x >= n8 ? 0u : 2 * x + 1 >= n8 ? (word & 0xffffu) : word;
          vf[y] = sg8x8_from_col_pairs(as_type<half2>(word), lane);
#else
          const uint4 v4 = vm[b + y];
          const uint word = w == 0 ? v4.x : w == 1 ? v4.y : w == 2 ? v4.z : v4.w;
          vf[y] = make_filled_simdgroup_matrix<half, 8, 8>(half(0.0f));
          vf[y].thread_elements() = as_type<half2>(word);
#endif
        }
        sg8x8_mma_k16(o_mma[w], pf[0], pf[1], vf[0], vf[1]);
      }
    }
  } else {
  for (uint g = 0; g < G; ++g) {
    for (uint i = 0; i < ROWS; ++i) acc[g][i] *= alpha_s[g];
  }
  for (uint k0 = 0; k0 < VPS; k0 += VPF) {
    if (k0 > 0) {
      LOAD_V_GROUP(k0);
    }
    LATHE_UNROLL
    for (uint k = 0; k < VPF; ++k) {
      const uint vi = simd + (k0 + k) * NSIMD;
      if (vi * 8 >= cn) continue;
      const uint valid = min(8u, t_end - (c0 + vi * 8));
      float pv[G][8];
      for (uint g = 0; g < G; ++g) {
        for (uint j = 0; j < 8; ++j) pv[g][j] = p_s[g * CH + vi * 8 + j];
      }
      float v8[ROWS][8];
#if LATHE_PAGED
      LATHE_UNROLL
      for (uint i = 0; i < ROWS; ++i) {
        const uint vu[4] = {vw[k][i].x, vw[k][i].y, vw[k][i].z, vw[k][i].w};
        for (uint j = 0; j < 4; ++j) {
          const half2 v2 = as_type<half2>(vu[j]);
          v8[i][2 * j] = float(v2.x);
          v8[i][2 * j + 1] = float(v2.y);
        }
      }
#else
      LATHE_UNROLL
      for (uint j = 0; j < 8; ++j) {
        LATHE_UNROLL
        for (uint w = 0; w < V_WORDS; ++w) {
          if (V_PAIRS) {
            const half2 v2 = as_type<half2>(vw[k][j][w]);
            v8[2 * w][j] = float(v2.x);
            v8[2 * w + 1][j] = float(v2.y);
          } else {
            v8[w][j] = float(as_type<half>(ushort(vw[k][j][w])));
          }
        }
      }
#endif
      LATHE_UNROLL
      for (uint i = 0; i < ROWS; ++i) {
        for (uint j = 0; j < 8; ++j) v8[i][j] = j < valid ? v8[i][j] : 0.0f;
        for (uint g = 0; g < G; ++g) {
          float a = acc[g][i];
          for (uint j = 0; j < 8; ++j) a = fma(pv[g][j], v8[i][j], a);
          acc[g][i] = a;
        }
      }
    }
  }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // p_s is rewritten by the next chunk
}
if (t_begin >= t_end) {  // an empty partition: no chunk marked its scores
  LATHE_MARK(1)
}
LATHE_MARK(2)

// The SIMD groups' sums, one after another into sum_s.
for (uint w = 0; w < (USE_MMA ? MMA_TG : NSIMD); ++w) {
  if (USE_MMA && simd / MMA_DG == w && mma_r < G) {  // row mma_r, columns MMA_DIM(f, mma_c) and + 1
    LATHE_UNROLL
    for (uint f = 0; f < 4; ++f) {
      const float2 e = o_mma[f].thread_elements();
      const uint at = mma_r * D + MMA_DIM(f, mma_c);
      sum_s[at] = (w == 0 ? 0.0f : sum_s[at]) + e.x;
      sum_s[at + 1] = (w == 0 ? 0.0f : sum_s[at + 1]) + e.y;
    }
  } else if (!USE_MMA && simd == w) {
    for (uint g = 0; g < G; ++g) {
      for (uint i = 0; i < ROWS; ++i) {
        const uint e = g * D + lane_dim(lane, i);
        sum_s[e] = (w == 0 ? 0.0f : sum_s[e]) + acc[g][i];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
for (uint e = tid; e < G * D; e += NT) {
  const uint g = e / D, d = e % D;
  const uint hq = hg * G + g;
  const float o = l_s[g] > 0.0f ? sum_s[e] / l_s[g] : 0.0f;
#if LATHE_SPLIT
  const uint at = (b * n_heads + hq) * uint(dims[3]) + part;
  part_out[at * D + d] = o;
  if (d == 0) {
    part_ml[2 * at] = m_s[g];
    part_ml[2 * at + 1] = l_s[g];
  }
#else
  out[(b * n_heads + hq) * D + d] = half(o);
#if defined(LATHE_OUT_CODES) && LATHE_OUT_CODES
  {
    // The output as the next GEMV's X' (the includer's o_codes, o_scales, o_sums: gemv/x_stage.metal's
    // int16 codes, scale and code sum a block of 32), a SIMD group a block (D is a multiple of 32),
    // from the fp16 value written and by x_stage's arithmetic: the bits the O phase would stage.
    const float v = float(half(o));
    const float block_max = simd_max(fabs(v));
    const float inv = code_inv(block_max);
    const int code = code_of(v, inv);
    const uint at = (b * n_heads + hq) * D + d;
    o_codes[at] = short(code);
    const int code_sum = simd_sum(code);
    if (lane == 0) {
      o_scales[at / 32] = code_scale(block_max);
      o_sums[at / 32] = code_sum;
    }
  }
#endif
#endif
}
#if LATHE_SPLIT && LATHE_MERGE
threadgroup_barrier(mem_flags::mem_device);  // every thread's partials are written
if (tid == 0) {
  const auto counter = counters + b * n_kv * QS + hg;
  merge_here = grid_signal(counter) == uint(dims[3]) - 1;
  if (merge_here) grid_reset(counter, 1);  // after the others' partials
}
threadgroup_barrier(mem_flags::mem_device);
if (merge_here) {
  // combine.metal's weights, worked out once a head and in parallel: a SIMD group a query head,
  // a lane MLANE partitions (the host's merge_lane: at most MERGE_PARTS in all; it launches the
  // combine past that).
  const uint parts = uint(dims[3]);
  for (uint g = simd; g < G; g += NSIMD) {
    const uint row = b * n_heads + hg * G + g;
    float mj[MLANE], lj[MLANE];
    LATHE_UNROLL
    for (uint j = 0; j < MLANE; ++j) {
      const uint p = lane + 32 * j;
      mj[j] = p < parts ? part_ml[2 * (row * parts + p)] : NEG_INF;
      lj[j] = p < parts ? part_ml[2 * (row * parts + p) + 1] : 0.0f;
    }
    float m_lane = mj[0];
    LATHE_UNROLL
    for (uint j = 1; j < MLANE; ++j) m_lane = max(m_lane, mj[j]);
    const float m_all = simd_max(m_lane);
    float wj[MLANE];
    LATHE_UNROLL
    for (uint j = 0; j < MLANE; ++j) wj[j] = lj[j] > 0.0f ? lj[j] * exp(mj[j] - m_all) : 0.0f;
    float w_lane = wj[0];
    LATHE_UNROLL
    for (uint j = 1; j < MLANE; ++j) w_lane += wj[j];
    const float den = simd_sum(w_lane);
    LATHE_UNROLL
    for (uint j = 0; j < MLANE; ++j) w_s[g * MERGE_PARTS + lane + 32 * j] = den > 0.0f ? wj[j] / den : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // out = sum_p w_p o_p, a thread a 4-value slot of the G heads' outputs (one 16-byte load a
  // partition), MLOADS partitions' loads (the host's merge_loads: up to 16, at most a run's
  // partitions) issued before any is used: 64 partitions in 4 L2 round trips. The last round of a
  // run is shifted back to end at its last partition, the partitions it repeats weighed 0, so
  // that every load is in range at a fixed offset from one address: NVRTC spread predicated loads
  // among their FMAs (about 100 L2 round trips in the tail), and clamped addresses took a register
  // pair a load (kernels/attention/NOTES.md). With MSPLIT 2 (the host's merge_splits, where the
  // slots take at most half the threads) a slot's partitions are two runs, the threads past the
  // slots taking the second: half the rounds. (Its first round asked for before the weights took
  // Qwen3's split token block from 168 registers to 244, NVRTC sm_90.)
  constexpr uint SLOTS = G * D / 4;
  constexpr uint MB = MLOADS;
  const uint s0 = MSPLIT == 1 ? tid : tid < 2 * SLOTS ? tid % SLOTS : SLOTS;  // (MSPLIT 2: SLOTS <= NT / 2)
  const uint run_lo = MSPLIT > 1 && tid >= SLOTS ? parts / 2 : 0;
  const uint run_hi = MSPLIT > 1 && tid < SLOTS ? parts / 2 : parts;
  float m4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint s = s0; s < SLOTS; s += NT) {
    const uint g = s / (D / 4);
    const auto slot = part_out + ((b * n_heads + hg * G + g) * parts * D + 4 * (s % (D / 4)));
    for (uint k = 0; k < 4; ++k) m4[k] = 0.0f;
    for (uint p0 = run_lo; p0 < run_hi; p0 += MB) {
      const uint pb = min(p0, run_hi - MB);  // a run holds MB partitions or more (the host's)
      const auto at = slot + pb * D;  // this round's first partition
      uint4 o[MB];
      LATHE_UNROLL
      for (uint j = 0; j < MB; ++j) o[j] = load_wide<uint4>(at, j * (D / 4));
      LATHE_UNROLL
      for (uint j = 0; j < MB; ++j) {
        const float w = pb + j >= p0 ? w_s[g * MERGE_PARTS + pb + j] : 0.0f;
        m4[0] = fma(w, as_type<float>(o[j].x), m4[0]);
        m4[1] = fma(w, as_type<float>(o[j].y), m4[1]);
        m4[2] = fma(w, as_type<float>(o[j].z), m4[2]);
        m4[3] = fma(w, as_type<float>(o[j].w), m4[3]);
      }
    }
    if (MSPLIT == 1)
      for (uint k = 0; k < 4; ++k) out[(b * n_heads + hg * G) * D + 4 * s + k] = half(m4[k]);
  }
  if (MSPLIT > 1) {  // the second runs' sums through sum_s (its partials are written), then added
    if (tid >= SLOTS && s0 < SLOTS)
      for (uint k = 0; k < 4; ++k) sum_s[4 * s0 + k] = m4[k];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < SLOTS)
      for (uint k = 0; k < 4; ++k) out[(b * n_heads + hg * G) * D + 4 * s0 + k] = half(m4[k] + sum_s[4 * s0 + k]);
  }
}
#endif