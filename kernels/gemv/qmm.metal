// Quantized GEMM for a few rows of X: Y[M, N] = X[M, K] @ W^T (+ residual), M up to 64, W repacked
// (kernels.gemv.repack: the decode loop's one copy of the weights, any v3 block type), on
// SIMD-group matrices (the tensor cores on CUDA: one m16n8k16 a paired product). A short prompt's
// projections: GEMV launches read W once for every 4 rows of X, dequantize + MLX's matmul writes and
// reads an fp16 copy of W; here W is read once for all M rows and decoded in registers.
//
// The K order inside a product is free, so each lane takes whole chunks of 32 weights: in a paired
// product (k16: two 8x8 k blocks), the lane that holds B's k slots c, c + 1 (its column pair,
// sg8x8_col) takes them from chunk c / 2 of a super-chunk of 4 chunks (128 values of K): step p
// (0..7) of the super-chunk reads weights 2p, 2p + 1 of that chunk in the first k block and
// 16 + 2p, 17 + 2p in the second. A's elements in that order are the same lane's 32 values of X
// (the same chunk, rows sg8x8_row and 8 further): four 16-byte loads a row, straight from device
// memory into the A operand. X is small and read by every SIMD group, so it stays in L1/L2; no
// SIMD group waits on another's staging (the barriers of a staged X, and its threadgroup memory,
// had capped K a piece and the bytes in flight: 16 rows of the 8B's 4096 x 4096 took 20.5 us
// alone, a97bf5f). Weights go from one 16-byte load (Q4_0; the K-quants' chunk words) to the B
// operand with no threadgroup round trip: Q4_0 and Q8_0 decoded in half2 (byte_perm into
// 1024.0h's mantissa), the other types by packed_chunk.metal in float32 (shared with dequantize).
//
// A threadgroup takes 8 * NB * WN rows of W: SIMD group s takes NB blocks of 8 rows (s % WN) and
// every WK-th super-chunk of the threadgroup's K (s / WN), so WK groups stream one row block's
// weights at once; their sums meet in threadgroup memory at the end. M is rounded up to MP (a
// multiple of 16): rows past M read as zeros and are not written.
//
// Fused as the GEMVs are: LATHE_NORM multiplies X by each row's 1 / rms (worked out first, a SIMD
// group a row, into threadgroup memory) and gamma as it loads it, rounded to half once as lathe's
// rmsnorm writes it; LATHE_GATED reads W as [gate; up] (N = 2F rows) and writes act(gate) * up
// [M, F]: a threadgroup's first NB / 2 row blocks are gate rows, the others the up rows F further
// on, so a lane holds the gate and the up sums of the same outputs (act: gate_act<LATHE_ACT>, in
// float32 before Y's one rounding).
//
// XS > 0 stages X in threadgroup memory for all of a threadgroup's SIMD groups (XS buffers, each a
// round of WK super-chunks of MP rows, filled by cp.async XS - 1 rounds ahead, one barrier a
// round), so that X comes from L2 once a threadgroup rather than once a SIMD group from L1: at
// 16 rows X was 8 M of the 10 M L1 sectors of the 8B's gate+up, read at 18 of each 32 bytes
// (e04a574). Each lane reads back the same 16-byte pieces it would have loaded; a row's pieces
// sit 2 pieces (32 bytes) past a whole bank line from the row before, and piece q of chunk c
// goes to q ^ (c / 2 & 1), so that the 8 lanes of a 16-byte phase (2 rows, 4 chunks) meet 8
// different bank quads. Rows past M copy row M - 1 and chunks past K chunk 0 (finite values;
// the lanes zero them as they read). Every SIMD group takes the same number of rounds (those
// past its part of K read zeros), since each round ends at a barrier.
//
// WR 1 (Q4_0, Q8_0; with XS) brings W's raw words through threadgroup memory on X's rounds: each
// lane copies its own chunk of each row block (and the 4-byte word holding its d) by cp.async in
// the same group as round t's X, XS - 1 rounds ahead, into a ring slot no other lane reads, and
// reads it back after the round's wait. So XS - 1 super-chunks of W are in flight a lane without
// registers holding them: at a5c36c6 the most sampled instruction was W's first use, and PF 1
// (registers) and a per-lane ring without staged X (an H100 session) had only moved that wait.
// WR 1..4 without XS: the same ring on its own schedule, WR super-chunks ahead in WR + 1 slots (a
// commit group a super-chunk; each lane waits for its own copies only, so no barrier). W's loads
// alone reach 84-89% of the copy peak with 4 super-chunks in flight a lane against 61% with one
// (w_order_probe, 3bd2061), but the GEMM with them was level with the rule or slower (b7b02d4):
// a sweep knob, no rule launches it.
//
// LATHE_SPLIT splits K over KS threadgroups a row block (grid.y; KSPL values of K each, a multiple
// of 128), so that a matrix of few row blocks still fills the GPU. Each writes its float32 sums
// to part [KS, M, N] (all N rows of W: gated, gate's and up's), and qmm_reduce.metal adds the KS
// partial sums and applies the epilogue (act(gate) * up, the residual) in a second launch.
// LATHE_LAST 1 adds them in this launch instead: the last of a row block's KS threadgroups to
// write its part (counters[row block] counts them, and that one leaves it zero for the next
// launch, as decode_rows.metal's merge) adds the KS parts in qmm_reduce's order and writes Y
// through the same epilogue. A launch fewer a split matrix: a host-bound step (Qwen3-0.6B's serve,
// about 10 us of MLX's host time a launch) pays for launches, not for the last group's adds.
//
// Constants: QTYPE, M, MP, NB, WN, WK, PF, XS, WST, WR (0; 1 with XS; 1..4 without), ROWS8 (W as
// RowBlocks: Q4_0 and Q8_0, N a multiple of 8, K of 128), K (a multiple of 32); LATHE_SPLIT: KS, KSPL.
// Inputs: x (half [M, K]), w (the repacked bytes), dims (int32: N, K); LATHE_NORM: gamma (half
// [K]), eps (float[1]); LATHE_LAST: counters (uint [>= row blocks], zero); LATHE_RESIDUAL adds
// residual (half [M, N]) before Y's one rounding.
// Output: y (half [M, N], or [M, N / 2] gated); LATHE_SPLIT: part (float [KS, M, N]) (and y with
// LATHE_LAST).
#ifndef LATHE_LAST
#define LATHE_LAST 0
#endif
constexpr uint MB = MP / 8;             // blocks of 8 rows of X
constexpr uint REDUCE = (WK - 1) * WN * NB * MB * 64;  // the partial sums of groups s / WN > 0
constexpr uint CHUNKS_K = K / 32;
constexpr uint NT = 32 * WN * WK;
threadgroup float partial[REDUCE > 0 ? REDUCE : 1];

const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint n = uint(dims[0]);
const uint wn = simd % WN, ks = simd / WN;
const uint r = sg8x8_row(lane), c = sg8x8_col(lane);
constexpr uint NBO = LATHE_GATED ? NB / 2 : NB;  // row blocks of outputs a SIMD group
const uint n_out = LATHE_GATED ? n / 2 : n;        // Y's columns (and each half's rows of W, gated)
const uint row0 = (threadgroup_position_in_grid.x * WN + wn) * NBO * 8;
const uint chunks = n * CHUNKS_K;
#if LATHE_SPLIT
const uint split = threadgroup_position_in_grid.y;
const uint k_begin = split * uint(KSPL), k_end = min(uint(K), k_begin + uint(KSPL));
#else
const uint k_begin = 0, k_end = K;
#endif
// XS: the rounds every SIMD group takes (WK super-chunks a round), X's buffers in 16-byte pieces
constexpr uint XS_ROW = 16 * WK + 2;  // a row's pieces in a buffer: WK super-chunks and 2 of padding
constexpr uint XS_BUF = MP * XS_ROW;
constexpr uint XS_N = XS > 0 ? XS : 1;  // the buffers' count in the unstaged kernel's dead code
const uint rounds = ((k_end - k_begin + 127) / 128 + WK - 1) / WK;
threadgroup uint4 x_staged[XS > 0 ? XS * XS_BUF : 1];
// WR: W's ring, slot (super-chunk t % W_SLOTS, row block j, word u) a uint4 a thread (tid:
// consecutive threads consecutive 16 bytes), and the word holding each block's d. On X's rounds
// (XS) a slot a buffer; on its own schedule (W_OWN) WR + 1 slots.
constexpr uint QW = QTYPE == 0 ? 1u : 2u;  // a Q4_0 chunk's quants: one 16-byte word; Q8_0's: two
constexpr bool W_RING = WR > 0 && QTYPE <= 1;
constexpr bool W_OWN = W_RING && XS == 0;
constexpr uint W_SLOTS = XS > 0 ? XS : WR + 1;
threadgroup uint4 w_ring[W_RING ? W_SLOTS * NB * QW * NT : 1];
threadgroup uint w_ring_d[W_RING ? W_SLOTS * NB * NT : 1];
const uint tid = simd * 32 + lane;
// W's block (row, chunk) of row block j for this lane in super-chunk S, and whether it is inside
// (a row past N, a chunk past K or past this launch's part of K: chunk 0, and d = 0)
// (ROWS8: W as RowBlocks, a row block's 8 rows interleaved a super-chunk at a time, so that the 32
// lanes' chunks of (row block, super-chunk) are 512 contiguous bytes)
#define QMM_W_INSIDE(S, J) (row0 + 8 * ((J) % NBO) + r < n_out && 4 * (S) + c / 2 < CHUNKS_K && (S) * 128 < k_end)
#define QMM_W_INDEX(ROW, S)                                                                            \
  (ROWS8 ? ((ROW) / 8 * (CHUNKS_K / 4) + (S)) * 32 + (ROW) % 8 * 4 + c / 2 : (ROW) * CHUNKS_K + 4 * (S) + c / 2)
#define QMM_W_BLOCK(S, J)                                                                              \
  (QMM_W_INSIDE(S, J) ? QMM_W_INDEX(((J) < NBO ? 0u : n_out) + row0 + 8 * ((J) % NBO) + r, S) : 0u)
// WR: super-chunk S's raw W of this lane into ring slot SLOT (d: the 4-byte word that holds it;
// the d array starts 16-byte aligned, so block b's d is half b % 2 of word (d's start + b) / 2).
// A block outside is not copied (its slot is read with d = 0): on its own schedule every SIMD group
// runs WR super-chunks past its part of K, and copies of block 0 from every warp of the grid met
// at one L2 line (ba98938: 2-3.4x slower, growing with WR and with the split's threadgroups).
#define QMM_RING_W(S, SLOT)                                                                            \
  LATHE_UNROLL for (uint j_ = 0; j_ < NB; ++j_) {                                                      \
    if (!QMM_W_INSIDE(S, j_)) continue;                                                                \
    const uint blk_ = QMM_W_BLOCK(S, j_), at_ = (SLOT) * NB + j_;                                      \
    async_copy_word(&w_ring_d[at_ * NT + tid], w, (chunks * (QW * 8) + blk_) / 2);                     \
    LATHE_UNROLL for (uint u_ = 0; u_ < QW; ++u_) {                                                    \
      async_copy_wide(&w_ring[(at_ * QW + u_) * NT + tid], w, blk_ * QW + u_);                         \
    }                                                                                                  \
  }
// round t's X into buffer t % XS, a piece a thread at a time (none past the last round)
#define QMM_STAGE_X(T)                                                                                 \
  if (W_RING && (T) < rounds) {                                                                        \
    QMM_RING_W(s_first + (T) * WK, (T) % XS_N)                                                         \
  }                                                                                                    \
  if ((T) < rounds) {                                                                                  \
    LATHE_UNROLL for (uint u_ = simd * 32 + lane; u_ < MP * 16 * WK; u_ += NT) {                      \
      const uint row_ = u_ / (16 * WK), in_row_ = u_ % (16 * WK), sc_ = in_row_ / 16;                 \
      const uint chunk_ = (in_row_ / 4) % 4, q_ = in_row_ % 4;                                         \
      const uint g_ = (k_begin / 128 + (T) * WK + sc_) * 4 + chunk_;                                   \
      const uint from_ = (min(row_, uint(M) - 1) * K) / 8 + (g_ < CHUNKS_K ? g_ * 4 + q_ : q_);        \
      const uint to_ = ((T) % XS_N) * XS_BUF + row_ * XS_ROW + sc_ * 16 + chunk_ * 4;                 \
      async_copy_wide(&x_staged[to_ + (q_ ^ (chunk_ >> 1))], x, from_);                                \
    }                                                                                                  \
  }                                                                                                    \
  async_commit();

#if LATHE_NORM
threadgroup float inv_rms[MP];
for (uint m = simd; m < M; m += NT / 32) {
  float ss = 0.0f;
  for (uint kk = 8 * lane; kk < K; kk += 256) {
    const uint4 words = load_wide<uint4>(x, (m * K + kk) / 8);
    const uint w4[4] = {words.x, words.y, words.z, words.w};
    LATHE_UNROLL for (uint j = 0; j < 4; ++j) {
      const half2 h = as_type<half2>(w4[j]);
      ss += float(h.x) * float(h.x) + float(h.y) * float(h.y);
    }
  }
  ss = simd_sum(ss);
  if (lane == 0) inv_rms[m] = rsqrt(ss / float(K) + eps[0]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
#endif

simdgroup_float8x8 acc[NB][MB];
LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
  LATHE_UNROLL for (uint mb = 0; mb < MB; ++mb) acc[j][mb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

// WST 1: W's loads (Q4_0, Q8_0) evict-first (load_stream): read once, they need not push X's lines
// out of L1, where X is read again by every SIMD group (e04a574: X's L1 hits 74% at 16 rows).
#define QMM_LOAD_W(T, I) (WST ? load_stream<T>(w, I) : load_wide<T>(w, I))
// Q4_0 and Q8_0: W's raw words (a chunk's quants, QW 16-byte words, and its fp16 d) of super-chunk
// S for this lane and each row block, into wq / wd. Branch-free: a row or chunk outside (past N,
// past K, past this launch's part of K) loads chunk 0 and gets d = 0, so the NB blocks' loads
// form one straight run that the compiler can issue before any is used.
#define QMM_RAW_W(S)                                                                                   \
  LATHE_UNROLL for (uint j = 0; j < NB; ++j) {                                                         \
    const uint blk_ = QMM_W_BLOCK(S, j);                                                               \
    const ushort d_ = QMM_LOAD_W(ushort, chunks * (QW * 8) + blk_);                                   \
    wd[j] = QMM_W_INSIDE(S, j) ? d_ : ushort(0);                                                       \
    LATHE_UNROLL for (uint u = 0; u < QW; ++u) wq[j][u] = QMM_LOAD_W(uint4, blk_ * QW + u);           \
  }
// PF 1 (Q4_0, Q8_0): the next super-chunk's raw W is loaded before this one's products, so that
// it is in flight while they are taken (registers for one more super-chunk of W).
constexpr bool AHEAD = PF > 0 && QTYPE <= 1;
uint4 wq[NB][QW];
ushort wd[NB];
const uint s_first = k_begin / 128 + ks;
if (AHEAD) {
  QMM_RAW_W(s_first)
}
if (XS > 0) {
  LATHE_UNROLL for (uint t = 0; t + 1 < XS; ++t) {
    QMM_STAGE_X(t)
  }
}
if (W_OWN) {  // the first WR super-chunks (those past this part of K copy nothing)
  LATHE_UNROLL for (uint t = 0; t < WR; ++t) {
    QMM_RING_W(s_first + t * WK, t)
    async_commit();
  }
}
// unstaged, a SIMD group's own super-chunks of its part; staged, the threadgroup's rounds
for (uint s = s_first, t = 0; XS ? t < rounds : s * 128 < k_end; s += WK, ++t) {
  const uint chunk_of_row = 4 * s + c / 2;
  // K is whole chunks: a chunk is all in or all out (and a staged round's past this part of K out)
  const bool k_inside = chunk_of_row < CHUNKS_K && (XS == 0 || s * 128 < k_end);
  uint x_buf = 0;
  if (XS > 0) {
    async_wait<(XS > 1 ? XS - 2 : 0)>();  // this thread's copies of round t are in ...
    threadgroup_barrier(mem_flags::mem_threadgroup);  // ... everyone's, and round t - 1 is read
    QMM_STAGE_X(t + XS - 1)  // into round t - 1's buffer
    x_buf = (t % XS_N) * XS_BUF + ks * 16 + (c / 2) * 4;
  }
  if (W_OWN) {  // super-chunk t + WR into the slot this lane read at t - 1; then t's copies are in
    QMM_RING_W(s + WR * WK, (t + WR) % W_SLOTS)
    async_commit();
    async_wait<(W_OWN ? WR : 0)>();
  }
  uint4 cq[NB][QW];  // this super-chunk's raw W (Q4_0, Q8_0)
  ushort cd[NB];
  if (W_RING) {  // this lane's own slot of super-chunk t, in since the wait above
    LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
      const uint at = (t % W_SLOTS) * NB + j, dw = w_ring_d[at * NT + tid];
      cd[j] = QMM_W_INSIDE(s, j) ? ushort(QMM_W_BLOCK(s, j) % 2 ? dw >> 16 : dw & 0xffffu) : ushort(0);
      LATHE_UNROLL for (uint u = 0; u < QW; ++u) cq[j][u] = w_ring[(at * QW + u) * NT + tid];
    }
  } else if (QTYPE <= 1) {
    if (!AHEAD) {
      QMM_RAW_W(s)
    }
    LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
      cd[j] = wd[j];
      LATHE_UNROLL for (uint u = 0; u < QW; ++u) cq[j][u] = wq[j][u];
    }
    if (AHEAD) {
      QMM_RAW_W(s + WK)
    }
  }
  uint bw[NB][16];  // this lane's chunk of each row block, half2 words: word i holds weights 2i, 2i + 1
  LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
    const uint out_row = row0 + 8 * (j % NBO) + r;  // gated: j < NB / 2 gate rows, the rest up rows
    const uint row = (j < NBO ? 0u : n_out) + out_row;
    const bool inside = out_row < n_out && k_inside;
    const uint blk = inside ? row * CHUNKS_K + chunk_of_row : 0u;  // the other types' loads
    if (QTYPE <= 1) {
      // Q4_0 and Q8_0 decode in half2, two weights an instruction. A byte q under 0x64 (the
      // high byte of 1024.0h) reads as 1024 + q exactly; less 1032 that is Q4_0's q - 8, and
      // Q8_0's signed q once its sign bit is flipped (1024 + q + 128, less 1152). One multiply
      // by d then rounds once, as the float32 product rounded to half does (both exact before
      // it). The float path below costs two quarter-rate conversions a weight: at 16 rows on
      // the 8B's 28672 x 4096 that alone was about 63 us of its 69.9 (534cfcd).
      const half d = as_type<half>(cd[j]);
      const half2 d2 = half2(d, d), offset = as_type<half2>(QTYPE == 0 ? 0x64086408u : 0x64806480u);
      LATHE_UNROLL for (uint u = 0; u < QW; ++u) {
        const uint4 word = cq[j][u];
        const uint w4[4] = {word.x, word.y, word.z, word.w};
        LATHE_UNROLL for (uint t = 0; t < 4; ++t) {
          // QTYPE 0: byte l's low nibble is weight l and its high nibble weight l + 16
          const uint lo = QTYPE == 0 ? w4[t] & 0x0f0f0f0fu : w4[t] ^ 0x80808080u;
          const uint hi = (w4[t] >> 4) & 0x0f0f0f0fu;
          LATHE_UNROLL for (uint h = 0; h < (QTYPE == 0 ? 2u : 1u); ++h) {
            const uint bytes = h ? hi : lo, at = QTYPE == 0 ? 8 * h + 2 * t : 8 * u + 2 * t;
            bw[j][at] = as_type<uint>((as_type<half2>(byte_perm(bytes, 0x64646464u, 0x5140u)) - offset) * d2);
            bw[j][at + 1] = as_type<uint>((as_type<half2>(byte_perm(bytes, 0x64646464u, 0x5342u)) - offset) * d2);
          }
        }
      }
    } else {
      float v[32];
#define PC_BYTES w
#include "gemv/packed_chunk.metal"
#undef PC_BYTES
      LATHE_UNROLL for (uint i = 0; i < 16; ++i) {
        bw[j][i] = inside ? as_type<uint>(half2(half(v[2 * i]), half(v[2 * i + 1]))) : 0u;
      }
    }
  }
  // X: this lane's chunk of K in rows r and r + 8 of each block pair, zeros past M (and past K).
  // Branch-free as W's: a row or chunk outside loads X's first chunk and is zeroed. A load under
  // a condition is a branch (it may not be issued speculatively), and each branch ended a run:
  // the PTX of a397c5c had every X load in a block of its own.
  const uint x_chunk = k_inside ? chunk_of_row * 4 : 0u;
#if LATHE_NORM
  uint gw[16];  // past K, gamma's first chunk: it meets zeroed X
  LATHE_UNROLL for (uint q = 0; q < 4; ++q) {
    const uint4 g = load_wide<uint4>(gamma, x_chunk + q);
    gw[4 * q] = g.x, gw[4 * q + 1] = g.y, gw[4 * q + 2] = g.z, gw[4 * q + 3] = g.w;
  }
#endif
  LATHE_UNROLL for (uint mb = 0; mb < MB; mb += 2) {
    uint xw[2][16];
    LATHE_UNROLL for (uint h = 0; h < 2; ++h) {
      const uint m = 8 * (mb + h) + r;
      const bool live = m < M && k_inside;
      const uint at = live ? (m * K) / 8 + x_chunk : 0u;
      LATHE_UNROLL for (uint q = 0; q < 4; ++q) {
        const uint4 v = XS > 0 ? x_staged[x_buf + m * XS_ROW + (q ^ (c / 4))] : load_wide<uint4>(x, at + q);
        xw[h][4 * q] = live ? v.x : 0u, xw[h][4 * q + 1] = live ? v.y : 0u;
        xw[h][4 * q + 2] = live ? v.z : 0u, xw[h][4 * q + 3] = live ? v.w : 0u;
      }
#if LATHE_NORM
      const float inv = m < M ? inv_rms[m] : 0.0f;
      LATHE_UNROLL for (uint i = 0; i < 16; ++i) {
        const half2 v = as_type<half2>(xw[h][i]), g = as_type<half2>(gw[i]);
        xw[h][i] = as_type<uint>(half2(half(float(v.x) * inv * float(g.x)), half(float(v.y) * inv * float(g.y))));
      }
#endif
    }
    LATHE_UNROLL for (uint p = 0; p < 8; ++p) {
      simdgroup_half8x8 a00, a01, a10, a11;
      a00.thread_elements() = as_type<half2>(xw[0][p]);
      a01.thread_elements() = as_type<half2>(xw[0][8 + p]);
      a10.thread_elements() = as_type<half2>(xw[1][p]);
      a11.thread_elements() = as_type<half2>(xw[1][8 + p]);
      LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
        const simdgroup_half8x8 b0 = sg8x8_from_col_pairs(as_type<half2>(bw[j][p]), lane);
        const simdgroup_half8x8 b1 = sg8x8_from_col_pairs(as_type<half2>(bw[j][8 + p]), lane);
        sg8x8_mma_k16x2(acc[j][mb], acc[j][mb + 1], a00, a01, a10, a11, b0, b1);
      }
    }
  }
}
#undef QMM_RAW_W
#undef QMM_LOAD_W
#undef QMM_STAGE_X
#undef QMM_RING_W
#undef QMM_W_BLOCK
#undef QMM_W_INDEX
#undef QMM_W_INSIDE

// The WK groups of a row block add up in threadgroup memory; the first writes Y.
if (WK > 1) {
  if (ks > 0) {
    LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
      LATHE_UNROLL for (uint mb = 0; mb < MB; ++mb) {
        const float2 e = acc[j][mb].thread_elements();
        const uint at = ((((ks - 1) * WN + wn) * NB + j) * MB + mb) * 64 + 2 * lane;
        partial[at] = e.x;
        partial[at + 1] = e.y;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (ks == 0) {
  float2 sums[NB][MB];
  LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
    LATHE_UNROLL for (uint mb = 0; mb < MB; ++mb) {
      sums[j][mb] = acc[j][mb].thread_elements();
      LATHE_UNROLL for (uint g = 1; g < WK; ++g) {
        const uint at = ((((g - 1) * WN + wn) * NB + j) * MB + mb) * 64 + 2 * lane;
        sums[j][mb].x += partial[at];
        sums[j][mb].y += partial[at + 1];
      }
    }
  }
#if LATHE_SPLIT
  // this split's sums of every row block (gated: the up blocks at their rows of W, n_out on)
  LATHE_UNROLL for (uint j = 0; j < NB; ++j) {
    LATHE_UNROLL for (uint mb = 0; mb < MB; ++mb) {
      const uint m = 8 * mb + r, col = row0 + 8 * (j % NBO) + c, at = (j < NBO ? 0u : n_out) + col;
      if (m >= M) continue;
      LATHE_UNROLL for (uint h = 0; h < 2; ++h) {
        if (col + h < n_out) part[(split * M + m) * n + at + h] = h ? sums[j][mb].y : sums[j][mb].x;
      }
    }
  }
#else
  LATHE_UNROLL for (uint j = 0; j < NBO; ++j) {
    LATHE_UNROLL for (uint mb = 0; mb < MB; ++mb) {
      const uint m = 8 * mb + r, col = row0 + 8 * j + c;
      if (m >= M) continue;
      LATHE_UNROLL for (uint h = 0; h < 2; ++h) {
        if (col + h >= n_out) continue;
        float out = h ? sums[j][mb].y : sums[j][mb].x;
#if LATHE_GATED
        out = gate_act<LATHE_ACT>(out) * (h ? sums[j + NBO][mb].y : sums[j + NBO][mb].x);
#endif
#if LATHE_RESIDUAL
        out += float(residual[m * n_out + col + h]);
#endif
        y[m * n_out + col + h] = half(out);
      }
    }
  }
#endif
}
#if LATHE_SPLIT && LATHE_LAST
// The row block's last part in: its threadgroup adds the KS parts of the block's WN * NBO * 8
// columns, a thread an output at a time, as qmm_reduce.metal does (qmm_add_parts.metal).
threadgroup uint qmm_last;
threadgroup_barrier(mem_flags::mem_device);  // every thread's part is written
if (tid == 0) {
  const auto counter = counters + threadgroup_position_in_grid.x;
  qmm_last = grid_signal(counter) == uint(KS) - 1;
  if (qmm_last) grid_reset(counter, 1);  // after the others' parts
}
threadgroup_barrier(mem_flags::mem_device);
if (qmm_last) {
  constexpr uint COLS = WN * NBO * 8;
  const uint first_col = threadgroup_position_in_grid.x * COLS;
  for (uint i = tid; i < uint(M) * COLS; i += NT) {
    const uint m = i / COLS, col = first_col + i % COLS;
    if (col >= n_out) continue;
#define QMM_Y_AT (m * n_out + col)
#include "gemv/qmm_add_parts.metal"
#undef QMM_Y_AT
  }
}
#endif
