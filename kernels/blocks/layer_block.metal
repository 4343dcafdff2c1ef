// Decoder blocks for decode tokens in one launch (the seeds' mega-kernels, on the seam's tickets):
// a run of PHASES phases along the cycle of a decoder's layer, starting at phase kind FIRST:
//   0 QKV   qkv   = (RMSNorm(x) * attn_norm) W_qkv^T                            v3 GEMV
//   1 ATTN  attn  = attention of the token over the cache: (Qwen3: per-head     decode_rows.metal, a task
//                   RMSNorm of Q and K), RoPE, K and V into cache row pos       per (partition, head group)
//   2 O     x_out = x + attn W_o^T                                              v3 GEMV + residual
//   3 UP    act   = silu(X' W_gate^T) * (X' W_up^T), X' = RMSNorm(x) * ffn_norm  v3 GEMV, SwiGLU epilogue
//   4 DOWN  x_mid = x + act W_down^T                                            v3 GEMV + residual
// Phase j is kind (FIRST + j) % 5 of layer (FIRST + j) / 5 of the launch: attention_block is
// FIRST 0, PHASES 3; ffn_block FIRST 3, PHASES 2; layer_block (a layer's FFN, the next layer's
// attention) FIRST 3, PHASES 5; token_block (a whole token's layers) FIRST 0, PHASES 5 * layers.
// Each phase is the kernel that runs it on its own (gemv/v3_rows.metal, attention/decode_rows.metal)
// and needs all of the phase before it (so, all phases before).
//
// Nothing waits on a threadgroup, only on work (gemv/seam.metal has the argument): the tickets of
// every phase but the last come from one counter in phase order, so every ticket a waiter needs
// was claimed before its own by a threadgroup already running, which finishes it without waiting
// on anything later; the last phase takes no tickets (nothing waits after it): threadgroup g runs
// its group g once the queue is empty. This needs running threadgroups to keep being scheduled
// while others spin, which NVIDIA GPUs give resident blocks; Metal promises no such thing, so
// kernels.blocks runs the phases as separate launches there (kernels.backends.cross_group_waits).
// ATTN_AHEAD: the attention phase asks the L2 for its cached K and V rows before its wait (an
// unsplit context, the contiguous caches or the batch form's paged pool; the block_attn_ahead option).
// SIGNAL_APART: the thread of another SIMD group than the claimer's signals a ticket done. The
// signal's release waits for the ticket's writes to drain (about a DRAM round trip) before its
// atomic goes out; from thread 0 that wait came before the next claim's own round trip (the 8B's
// tickets were claimed 1.2-3 us after their threadgroup's last was done). Apart, the two overlap,
// and the claim order (after this ticket is finished) is as before.
// PREFETCH (bit kind a GEMV phase's kind, the block_prefetch and block_prefetch_skip options): that
// phase issues its first weights before it waits on the phase before (they need nothing of it:
// v3_rows' GEMV_BEFORE_X), so the wait overlaps their DRAM round trip; L2_AHEAD
// (with PREFETCH): it also asks the L2 for the rest of its ticket's rows, so the DRAM keeps
// reading through the wait (v3_rows' GEMV_L2_AHEAD).
// POST_NORMS (token_block; Gemma's layer): the residual stream is float32 and each block's output
// is RMS-normed before it is added (post_attention_norm, post_ffw_norm). O and DOWN then write the
// block's output alone (blk, fp16); the phase after each (UP, the next QKV) forms x + RMSNorm(blk)
// * post_norm in threadgroup memory (x_post) before it stages X' from it, and its group 0 writes
// that row for the readers after it (UP: x_out, QKV: x_mid; layer 0's QKV copies x_in). Every
// threadgroup of the phase forms the same d_model values (a few KB): no sixth phase, no wait. The
// launch's output is x_out and the last DOWN's blk: the host adds the last post-norm.
// O_CODES (an unsplit context; the block_o_codes option, by default the batch and prompt forms): each
// attention ticket also writes its output as the O phase's X' (int16 codes, a scale and a code sum
// a block of 32: outputs o_codes, o_scales, o_sums), which the O tickets copy (gemv/x_codes.metal)
// where each quantized all M rows of attn_out: 8 rows of 2048 values a ticket in Qwen3's step of 8.
// ACT_CODES (any M; the block_act_codes option): the UP phase also writes act as the DOWN phase's
// X' (outputs act_codes, act_scales, act_sums), each block of 32 columns quantized by the last SIMD
// group to write it (gemv/y_codes.metal: a count a block in the queue, after its lines), and the
// DOWN tickets copy it where each quantized all M rows of act.
// RMS_LATE (the block_rms_late option): the QKV and UP phases stage X' as x * norm with no pass over
// x first, each row's sum of squares taken from the staging's loads, and scale their sums by the
// row's 1 / RMS (gemv/x_stage.metal's X_RMS_LATE), where X' is one chunk.
// QKV_BIAS (Qwen2's layer): the QKV phase adds layer l's [q; k; v] biases (qkv_bias + l *
// QKV_BIAS_STRIDE, fp16) to its outputs before their one rounding (v3_rows' GEMV_BIAS).
// LAYER_WINDOWS: layer l's attention sees its last windows[l] positions (0: all; Gemma 3's
// sliding layers); ROPE_STRIDE: layer l turns by inv_freqs + l * ROPE_STRIDE (a table a layer
// where bases differ; 0: one table); LATHE_ACT (1: GELU), LATHE_SOFTCAP: as their kernels'.
// Split attention (LATHE_SPLIT, long contexts): the partitions of a head group are merged by the
// last of them to finish (LATHE_MERGE, decode_attention.metal), before it counts its task done.
//
// Layer l's weights are at l * W_*_STRIDE bytes (64-bit: a stack may pass 4 GB) (norms: l * d_model, head norms: l * D values) of
// their input, 0 where the launch has one layer of each kind; its caches are LATHE_K_CACHE(l) and
// LATHE_V_CACHE(l) (the prelude's choice among k_cache_0 .., v_cache_0 ..). The residual stream
// goes x_in -> (ATTN) x_out -> (FFN) x_mid -> x_out ..., each phase after all readers of what it
// overwrites are done; scratch (act, qkv, attn_out, partitions, merge counters) is reused a layer.
//
// queue: uint32 [(PHASES + 2) * QUEUE_STRIDE + BLOCK_COUNTS], zero before a launch and left zero
// after it: tickets claimed, each phase but the last done, threadgroups out, then (PROMPT_ROWS) each
// query's new K/V rows written (M words), each on a 256-byte line of its own; then ACT_CODES' counts. One queue (and one set of
// merge counters) per launch in flight, and launches that share one ordered by their data.
// PROMPT_ROWS (M > 1 over contiguous caches: token_block's prompt form): the M tokens are one
// sequence's, at pos[0], pos[0] + 1, ..; query b sees the rows of queries 0..b - 1 that this launch
// writes. Each attention ticket writes its query's new row first, counts it on its query's word of
// the rows line, and then waits for the words of the queries before its own (their tickets were
// claimed before it: no deadlock). A count a query, not one for all: a later query's rows, written
// first, must not stand in for an earlier one's.
// TIMELINE (kernels.blocks' timeline=True; CUDA only): thread 0 of each ticket stamps it
// (timeline_stamp: ns, cycles, SM) into the output stamps, uint32 [tickets, TIMELINE_STAMPS, 3], a
// row a ticket in claim order and then the last phase's groups: when it was claimed, when its wait
// for the phase before was over, and when its outputs were written (before its signal); with
// TIMELINE_STAMPS 6 (block_timeline_marks), then an attention ticket's marks inside (decode_rows'
// LATHE_MARK: query ready, first scores, last P.V; in time: stamps 0, 1, 3, 4, 5, 2). The other
// tickets leave those three unwritten (each stamp costs; the reader fills them from the third).
// Block types: each GEMV's matrix has its own (blocks/typed_rows.metal): Q_<kind>_A, and
// Q_<kind>_B for the layers whose bit <kind> is set in layer_types[layer] (a word a layer of the
// launch; Q_<kind>_B == Q_<kind>_A and no layer_types where every layer has one type). QKV_SPLIT
// (a file whose attn_v differs in type from attn_q and attn_k in some layer): the QKV phase's
// tickets are those of w_qkv ([q; k], qkv_dims) and then w_v's (v_dims, types Q_V_A / Q_V_B, bit
// V_BIT, W_V_STRIDE, R_V, P_V), V's rows written after Q and K's in qkv.
// Constants: FIRST, PHASES, ROPE_STRIDE, v3's QTYPE, M, NSIMD and XCHUNK (the launch's: one threadgroup size,
// one X' staging, which every GEMV's type shares), SIGNAL_APART, RMS_LATE, PREFETCH, L2_AHEAD, XITEMS, ROW_PASSES, each GEMV's K, R and P (its own rows
// a SIMD group and loads in flight, kernels.blocks.block_geometry): K_UP (d_model), K_DOWN (F),
// K_QKV (d_model), K_O (n_heads * D), R_UP (even), R_DOWN, R_QKV, R_O, P_UP, P_DOWN, P_QKV, P_O,
// W_QKV_STRIDE, W_O_STRIDE, W_UP_STRIDE, W_DOWN_STRIDE, NORM_STRIDE, HEAD_NORM_STRIDE; with ATTN
// the attention's D, G, QS, BS (0), NEOX, FREQ_TABLE, KSLOTS, KIN_X, MMA, VSTRAIGHT, KEARLY, MLOADS, MLANE, MSPLIT
// (split). Prelude: FFN, ATTN (the kinds present), LATHE_K_CACHE, LATHE_V_CACHE, the block types
// above, QKV_SPLIT, POST_NORMS, LAYER_WINDOWS, LATHE_ACT, LATHE_SOFTCAP;
// with ATTN LATHE_PAGED 0, LATHE_ROPE 1, LATHE_SPLIT, LATHE_MERGE (= LATHE_SPLIT), LATHE_HEAD_NORM.
// Inputs (kernels.blocks names them): x_in, eps, block_dims (int32: threadgroups launched,
// attention tasks a layer), queue; FFN: ffn_norm, w_gate_up ([gate; up]), up_dims (int32: 2F,
// d_model, tickets), w_down, down_dims (d_model, F, tickets); ATTN: attn_norm, w_qkv, qkv_dims,
// k_cache_i, v_cache_i ([Hkv, max_seq, D] each, written in place), pos, inv_freqs, rope_scalars,
// dims (decode_attention's), scale, q_norm, k_norm (LATHE_HEAD_NORM), counters (split), w_o,
// o_dims; QKV_SPLIT: w_v, v_dims; mixed types: layer_types (uint32 [layers of the launch]);
// POST_NORMS: post_attn_norm, post_ffn_norm (fp16, as the norms); LAYER_WINDOWS: windows (int32
// [layers]); QKV_BIAS: qkv_bias (fp16 [layers, QKV_BIAS_STRIDE]). Outputs: FFN: act [M, F],
// x_mid [M, d_model]; ATTN: qkv [M, n_qkv], attn_out [M, Hq, D], x_out [M, d_model], part_out and
// part_ml (split); POST_NORMS: blk [1, d_model] (x_in, x_mid and x_out float32). M > 1 with ATTN:
// token_block's batch form, LATHE_PAGED 1: query b of the M tokens is sequence b's, at pos[b],
// its blocks in row b of the input `table`, the caches each layer's paged pool.
#define GEMV_RMS_LATE RMS_LATE  // QKV's and UP's RMSNorm from the staging's loads (the block_rms_late option)
#include "gemv/v3_tiles.metal"
#ifndef O_CODES
#define O_CODES 0
#endif
#ifndef ACT_CODES
#define ACT_CODES 0
#endif
#if ATTN
#define LATHE_K_SLOTS KSLOTS  // K through threadgroup memory (the block_k_slots option; 0: registers)
#define LATHE_MMA MMA  // scores and P.V on SIMD-group matrices (the block_attn_mma option)
#define LATHE_V_STRAIGHT VSTRAIGHT  // paged V loads without a branch (the block_v_straight option)
#define LATHE_K_EARLY KEARLY  // K's first round copied before the wait, the new row's filled in (block_k_early)
// KIN_X (the block_k_in_x option): K's slots in the staged X' where no room is left beside it.
// A ticket is one phase: the attention's copies are all read before its end barrier, and a GEMV
// ticket stages its own X' after its start.
#define LATHE_K_SLOTS_IN KIN_X
#define LATHE_K_SLOTS_HOST x_tile
#include "attention/decode_tiles.metal"
static_assert(!KIN_X || K_SLOTS * KG * NT <= M * UNITS * XC,
              "K's slots in the staged X': more than it holds");
#endif
#define GEMV_L2_AHEAD (L2_AHEAD && PREFETCH)
#define PREFETCH_OF(kind) ((uint(PREFETCH) >> (kind)) & 1u)  // bit kind: that GEMV phase prefetches
#define X_STAGE_ITEMS XITEMS  // the GEMV phases' X' staging: items a thread a pass (the block_x_items option)
#define GEMV_ROW_PASSES ROW_PASSES  // each GEMV phase's passes to its own K (the gemv_row_passes option)
constexpr uint QUEUE_STRIDE = 64;
#if ATTN && !LATHE_PAGED
constexpr bool PROMPT_ROWS = M > 1;
#else
constexpr bool PROMPT_ROWS = false;
#endif
enum : uint { QKV = 0, ATTN_ROWS = 1, O = 2, UP = 3, DOWN = 4, V_BIT = 5 };
constexpr uint LAST = (FIRST + PHASES - 1) % 5;
static_assert(LAST == O || LAST == DOWN, "a launch ends with a GEMV whose groups need no tickets");
threadgroup uint ticket;
const uint launched = uint(block_dims[0]);
// Tickets of a phase of each kind (zero where a kind is absent).
#if FFN
const uint up_tickets = uint(up_dims[2]);
const uint down_tickets = uint(down_dims[2]);
#else
const uint up_tickets = 0, down_tickets = 0;
#endif
#if ATTN
#if QKV_SPLIT
const uint qkv_tickets = uint(qkv_dims[2]) + uint(v_dims[2]);  // Q and K's rows, then V's
#else
const uint qkv_tickets = uint(qkv_dims[2]);
#endif
const uint attn_tickets = uint(block_dims[1]);
// values of a token's QKV row (q, k, v): the QKV phase's Y stride, and the attention's row of query b
#if QKV_SPLIT
const uint qkv_row = uint(qkv_dims[0]) + uint(v_dims[0]);
#else
const uint qkv_row = uint(qkv_dims[0]);
#endif
const uint o_tickets = uint(o_dims[2]);
#else
const uint qkv_tickets = 0, attn_tickets = 0, o_tickets = 0;
#endif
const uint kind_tickets[5] = {qkv_tickets, attn_tickets, o_tickets, up_tickets, down_tickets};
const uint cycle = qkv_tickets + attn_tickets + o_tickets + up_tickets + down_tickets;
uint claimable = 0;  // the tickets of every phase but the last
for (uint j = 0; j + 1 < PHASES; ++j) claimable += kind_tickets[(FIRST + j) % 5];
const auto claimed = queue, groups_out = queue + PHASES * QUEUE_STRIDE;
#if POST_NORMS
static_assert(FFN && ATTN, "post-block norms run in a launch of whole layers (token_block)");
threadgroup uint4 x_post_words[K_QKV / 4];
const auto x_post = threadgroup_view<float>(x_post_words);  // the stream this phase stages (float)
#endif
#define DONE(j) (queue + (1 + (j)) * QUEUE_STRIDE)  // phase j's tickets done
#define ROWS_WRITTEN (queue + (PHASES + 1) * QUEUE_STRIDE)  // PROMPT_ROWS: query b's rows written at word b
#define ACT_COUNTS (queue + (PHASES + 2) * QUEUE_STRIDE)  // ACT_CODES: a count a block of act's columns
#if TIMELINE
#define STAMP(i) \
  if (tid == 0) timeline_stamp(stamps + (stamp_row * TIMELINE_STAMPS + (i)) * 3);
#if TIMELINE_STAMPS > 3
#define LATHE_MARK(i) STAMP(3 + (i))  // decode_rows.metal's marks inside an attention ticket
#endif
// GROUP_STAMP(i): the threadgroup's own row after the tickets' (0 its start, 1 out of its claims,
// 2 its exit), so that the host sees what of the launch lies outside the tickets' stamps.
#define GROUP_STAMP(i)                                                                        \
  if (tid == 0)                                                                               \
    timeline_stamp(stamps + ((claimable + kind_tickets[LAST] + threadgroup_position_in_grid.x) \
                                 * TIMELINE_STAMPS + (i)) * 3);
#else
#define STAMP(i)
#define GROUP_STAMP(i)
#endif
GROUP_STAMP(0)

// The residual stream a phase of this kind at phase j reads (QKV, UP) or adds (O, DOWN).
#if FFN && ATTN
#define STREAM_IN(kind, j) ((j) == ((kind) == QKV || (kind) == UP ? 0u : (kind) == O ? 2u : 1u) ? x_in \
                            : (kind) == QKV || (kind) == O ? x_mid : x_out)
#else
#define STREAM_IN(kind, j) x_in
#endif

// Run phase j (kind, layer) for `group` (a ticket, or the threadgroup in the last phase).
#define PHASE_WAIT(j)                                                                           \
  if ((j) > 0) {                                                                                \
    if (tid == 0) grid_wait(DONE((j) - 1), kind_tickets[(FIRST + (j) - 1) % 5]);                \
    threadgroup_barrier(mem_flags::mem_device);  /* all of the phase before is visible */       \
  }                                                                                             \
  STAMP(1)

for (;;) {
  if (tid == 0) ticket = grid_ticket(claimed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint t = ticket;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // read by all before the next claim
  uint j = PHASES - 1, group = threadgroup_position_in_grid.x;  // the last phase: no ticket
  if (t < claimable) {
    // Any 5 phases in a row hold one cycle's tickets: skip whole cycles, then walk.
    uint base = t / cycle * cycle;
    j = t / cycle * 5;
    for (; t >= base + kind_tickets[(FIRST + j) % 5]; ++j) base += kind_tickets[(FIRST + j) % 5];
    group = t - base;
  } else if (group >= kind_tickets[LAST]) {
    break;
  }
  const uint kind = (FIRST + j) % 5;
  const uint layer = (FIRST + j) / 5;
  const bool last = j == PHASES - 1;
  const bool writer = group == 0;  // POST_NORMS: the threadgroup that writes the phase's stream row
#if TIMELINE
  const uint stamp_row = t < claimable ? t : claimable + group;
#endif
  STAMP(0)
  if (kind == UP || kind == DOWN) {
#if FFN
    const auto gamma = ffn_norm + layer * NORM_STRIDE;
    if (kind == UP) {
#define LATHE_PROLOGUE 1
#define LATHE_RESIDUAL 0
#define LATHE_EPILOGUE 1
#if POST_NORMS
#define LATHE_X32 1
#define POST_ADD post_norm_add<NSIMD>(x_post, x_out, writer, x_mid, blk, post_attn_norm + layer * NORM_STRIDE, true, \
                                      eps[0], K_UP, tid, scratch, simd, lane);
      auto x = x_post;
#else
#define LATHE_X32 0
#define POST_ADD
      auto x = STREAM_IN(UP, j);
#endif
#define GEMV_BEFORE_X if (PREFETCH_OF(UP)) { PHASE_WAIT(j) POST_ADD }
      if (!PREFETCH_OF(UP)) { PHASE_WAIT(j) POST_ADD }
      auto w = w_gate_up + size_t(layer) * W_UP_STRIDE;
      auto y = act;
      {
        auto dims = up_dims;
        constexpr uint KR = K_UP, RR = R_UP, PR = P_UP;
#if ACT_CODES
#define GEMV_Y_CODES act_codes  // act as the DOWN phase's X', a block by its last writer (gemv/y_codes.metal)
#define GEMV_Y_SCALES act_scales
#define GEMV_Y_SUMS act_sums
#define GEMV_Y_COUNTS ACT_COUNTS
#endif
#define ROWS_QA Q_UP_A
#define ROWS_QB Q_UP_B
#define ROWS_BIT UP
#include "blocks/typed_rows.metal"
#if ACT_CODES
#undef GEMV_Y_CODES
#undef GEMV_Y_SCALES
#undef GEMV_Y_SUMS
#undef GEMV_Y_COUNTS
#endif
      }
#undef GEMV_BEFORE_X
#undef POST_ADD
#undef LATHE_X32
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
#undef LATHE_EPILOGUE
    } else {
#define LATHE_PROLOGUE 0
#define LATHE_X32 0
#define GEMV_BEFORE_X if (PREFETCH_OF(DOWN)) { PHASE_WAIT(j) }
      if (!PREFETCH_OF(DOWN)) { PHASE_WAIT(j) }
#if POST_NORMS
#define LATHE_RESIDUAL 0
      auto y = blk;
#else
#define LATHE_RESIDUAL 1
      auto residual = STREAM_IN(DOWN, j);
      auto y = x_mid;
#endif
      auto x = act;
      auto w = w_down + size_t(layer) * W_DOWN_STRIDE;
      {
        auto dims = down_dims;
        constexpr uint KR = K_DOWN, RR = R_DOWN, PR = P_DOWN;
#if ACT_CODES
#define GEMV_X_CODES act_codes  // X' as the UP phase's last writers quantized it
#define GEMV_X_SCALES act_scales
#define GEMV_X_SUMS act_sums
#endif
#define ROWS_QA Q_DOWN_A
#define ROWS_QB Q_DOWN_B
#define ROWS_BIT DOWN
#include "blocks/typed_rows.metal"
#if ACT_CODES
#undef GEMV_X_CODES
#undef GEMV_X_SCALES
#undef GEMV_X_SUMS
#endif
      }
#undef GEMV_BEFORE_X
#undef LATHE_X32
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
    }
#endif
  } else {
#if ATTN
    const auto gamma = attn_norm + layer * NORM_STRIDE;
    if (kind == QKV) {
#define LATHE_PROLOGUE 1
#define LATHE_RESIDUAL 0
#if POST_NORMS
#define LATHE_X32 1
// layer 0: x_in as it is; then the stream after the last FFN with that FFN's post-norm
#define POST_ADD                                                                                        \
  if (j == 0) {                                                                                         \
    post_norm_add<NSIMD>(x_post, x_mid, writer, x_in, blk, post_ffn_norm, false, eps[0], K_QKV, tid,    \
                         scratch, simd, lane);                                                          \
  } else {                                                                                              \
    post_norm_add<NSIMD>(x_post, x_mid, writer, x_out, blk, post_ffn_norm + (layer - 1) * NORM_STRIDE,  \
                         true, eps[0], K_QKV, tid, scratch, simd, lane);                                \
  }
      auto x = x_post;
#else
#define LATHE_X32 0
#define POST_ADD
      auto x = STREAM_IN(QKV, j);
#endif
#define GEMV_BEFORE_X if (PREFETCH_OF(QKV)) { PHASE_WAIT(j) POST_ADD }
      if (!PREFETCH_OF(QKV)) { PHASE_WAIT(j) POST_ADD }
#if QKV_BIAS
      auto bias = qkv_bias + layer * QKV_BIAS_STRIDE;  // this layer's [q; k; v] biases
#define GEMV_BIAS bias
#endif
#define GEMV_Y_STRIDE qkv_row  // M tokens' rows of [q; k; v] (V's written after Q and K's)
#if QKV_SPLIT
      if (group >= uint(qkv_dims[2])) {  // V's rows: a matrix (and type) of their own, after Q and K's
        auto w = w_v + size_t(layer) * W_V_STRIDE;
        auto y = qkv + uint(qkv_dims[0]);
#if QKV_BIAS
        auto bias = qkv_bias + layer * QKV_BIAS_STRIDE + uint(qkv_dims[0]);  // V's, after Q and K's
#endif
        const uint v_group = group - uint(qkv_dims[2]);
        {
          const uint group = v_group;
          auto dims = v_dims;
          constexpr uint KR = K_QKV, RR = R_V, PR = P_V;
#define ROWS_QA Q_V_A
#define ROWS_QB Q_V_B
#define ROWS_BIT V_BIT
#include "blocks/typed_rows.metal"
        }
      } else
#endif
      {
        auto w = w_qkv + size_t(layer) * W_QKV_STRIDE;
        auto y = qkv;
        auto dims = qkv_dims;
        constexpr uint KR = K_QKV, RR = R_QKV, PR = P_QKV;
#define ROWS_QA Q_QKV_A
#define ROWS_QB Q_QKV_B
#define ROWS_BIT QKV
#include "blocks/typed_rows.metal"
      }
#ifdef GEMV_BIAS
#undef GEMV_BIAS
#endif
#undef GEMV_Y_STRIDE
#undef GEMV_BEFORE_X
#undef POST_ADD
#undef LATHE_X32
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
    } else if (kind == O) {
#define LATHE_PROLOGUE 0
#define LATHE_X32 0
#define GEMV_BEFORE_X if (PREFETCH_OF(O)) { PHASE_WAIT(j) }
      if (!PREFETCH_OF(O)) { PHASE_WAIT(j) }
#if POST_NORMS
#define LATHE_RESIDUAL 0
      auto y = blk;
#else
#define LATHE_RESIDUAL 1
      auto residual = STREAM_IN(O, j);
      auto y = x_out;
#endif
      auto x = attn_out;
      auto w = w_o + size_t(layer) * W_O_STRIDE;
      {
        auto dims = o_dims;
        constexpr uint KR = K_O, RR = R_O, PR = P_O;
#if O_CODES
#define GEMV_X_CODES o_codes  // X' as the attention tickets quantized it (decode_rows' LATHE_OUT_CODES)
#define GEMV_X_SCALES o_scales
#define GEMV_X_SUMS o_sums
#endif
#define ROWS_QA Q_O_A
#define ROWS_QB Q_O_B
#define ROWS_BIT O
#include "blocks/typed_rows.metal"
#if O_CODES
#undef GEMV_X_CODES
#undef GEMV_X_SCALES
#undef GEMV_X_SUMS
#endif
      }
#undef GEMV_BEFORE_X
#undef LATHE_X32
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
    } else {
      // a query's tasks: its partitions' (dims[3]; 1 unsplit), each kv heads x QS; query b of the
      // M tokens (a batch's sequences, paged: token_block's table form) after query b - 1's
      const uint head_groups = uint(dims[0]) * QS, per_query = head_groups * uint(dims[3]);
      const uint b = group / per_query, part = group % per_query / head_groups, hg = group % head_groups;
      auto out = attn_out;
      auto k_cache = LATHE_K_CACHE(layer);
      auto v_cache = LATHE_V_CACHE(layer);
      auto inv_freq = inv_freqs + layer * ROPE_STRIDE;
#if LAYER_WINDOWS
#define LATHE_WINDOW uint(windows[layer])
#endif
#if !LATHE_SPLIT
      if (ATTN_AHEAD) {
        // The ticket's cached K and V rows of the tokens before this one (decode_rows' t_begin ..
        // t_end short of the new row) into the L2 while it waits: earlier launches wrote them, so
        // they need nothing of the QKV phase, and its first loads then find them there. Not where
        // the launch splits the context: 264 tickets' prefetches then slowed the QKV phase they
        // overlap and the attention itself (Qwen3-0.6B at 4096 tokens; kernels/loop/NOTES.md).
        const uint rows_a = uint(dims[1]), q_at = uint(pos[b]);
        const uint ctx_a = min(q_at + 1, rows_a * uint(LATHE_PAGED ? BS : 1));
#if LAYER_WINDOWS
        const uint win_a = uint(windows[layer]);
#else
        const uint win_a = 0u;
#endif
        const uint from_a = (win_a > 0 && ctx_a > win_a ? ctx_a - win_a : 0u) & ~7u;
        const uint lo = from_a, hi = min(ctx_a, q_at);
        if (hi > lo) {
#if LATHE_PAGED
          // The batch form's pool: the K (and V) rows of a kv head in a block are BS * D values
          // in a row (decode_rows' K_ROW), so each of the query's blocks is two runs of lines, the
          // block's number from the table (the ticket's waits leave the table's loads time).
          constexpr uint LINES = BS * D * 2 / 128;  // 128-byte lines of K (or V) a block and head
          const uint first_block = lo / BS, blocks = (hi - 1) / BS + 1 - first_block;
          const uint row0 = b * uint(dims[4]) * rows_a, n_kv_a = uint(dims[0]);
          for (uint e = tid; e < blocks * 2 * LINES; e += NT) {
            const uint blk = uint(table[row0 + first_block + e / (2 * LINES)]);
            const size_t at = (size_t(blk) * n_kv_a + hg / QS) * (BS * D * 2) + (e % LINES) * 128;
            if (e / LINES % 2 == 0) {
              prefetch_l2(k_cache, at, 128, 0, 1);
            } else {
              prefetch_l2(v_cache, at, 128, 0, 1);
            }
          }
#else
          const size_t at = (size_t(hg / QS) * rows_a + lo) * D * 2, bytes = size_t(hi - lo) * D * 2;
          prefetch_l2(k_cache, at, bytes, tid, NT);
          prefetch_l2(v_cache, at, bytes, tid, NT);
#endif
        }
      }
#endif
      // KEARLY: the wait comes after decode_rows' first copies of K (its LATHE_BEFORE_QUERY)
      if (!KEARLY) {
        PHASE_WAIT(j)
      }
#define LATHE_BEFORE_QUERY \
  if (KEARLY) {            \
    PHASE_WAIT(j)          \
  }
#if LATHE_HEAD_NORM
      auto q_norm = q_norms + layer * HEAD_NORM_STRIDE;
      auto k_norm = k_norms + layer * HEAD_NORM_STRIDE;
#endif
      {
#define LATHE_QKV_ROW qkv_row
#define LATHE_NEW_ROWS PROMPT_ROWS
#define LATHE_OUT_CODES O_CODES
// query q's new rows counted once a head group (the QS tickets of a kv head in the partition
// holding its row) a layer of the launch, at word q
#define LATHE_ROWS_COUNTER(q) (ROWS_WRITTEN + (q))
#define LATHE_ROWS_WRITTEN ((layer + 1) * head_groups)
#include "attention/decode_rows.metal"
#ifdef LATHE_BEFORE_QUERY
#undef LATHE_BEFORE_QUERY
#endif
#undef LATHE_ROWS_WRITTEN
#undef LATHE_ROWS_COUNTER
#undef LATHE_OUT_CODES
#undef LATHE_NEW_ROWS
#undef LATHE_QKV_ROW
      }
#undef LATHE_WINDOW
    }
#endif
  }
  if (last) {
#if TIMELINE
    threadgroup_barrier(mem_flags::mem_device);  // the stamp after every thread's outputs
#endif
    STAMP(2)
    break;
  }
  threadgroup_barrier(mem_flags::mem_device);  // this ticket's outputs are written
  STAMP(2)
  // (the claimer, thread 0, goes on to its next claim; SIGNAL_APART: the signaller is thread 32)
  if (tid == (SIGNAL_APART && NT > 32 ? 32u : 0u)) grid_signal(DONE(j));
}
#undef STAMP
GROUP_STAMP(1)
#ifdef LATHE_MARK
#undef LATHE_MARK
#endif
#undef PHASE_WAIT
#undef STREAM_IN
#undef DONE

// The last threadgroup out leaves the queue zero for the next launch (every other one has made
// its last claim and its last read of the done counts before it counts itself out); its threads
// share the resets (a token's launch has a line a phase).
threadgroup uint last_out;
if (tid == 0) last_out = grid_signal(groups_out) == launched - 1;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (last_out) {
  for (uint i = tid; i <= PHASES; i += NT) grid_reset(queue + i * QUEUE_STRIDE, 1);
  if (PROMPT_ROWS && tid == NT - 1) grid_reset(ROWS_WRITTEN, M);
}
#if TIMELINE
threadgroup_barrier(mem_flags::mem_device);  // (the resets written)
#endif
GROUP_STAMP(2)
#undef GROUP_STAMP
