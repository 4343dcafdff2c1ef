// The blocks of a decoder layer for decode tokens, in one launch (the seeds' mega-kernels, on the
// seam's tickets). Two halves, each switched on at compile time:
//  FFN (M = 1..4 rows):
//   1. act   = silu(X' W_gate^T) * (X' W_up^T), X' = RMSNorm(x_in) * ffn_norm   v3 GEMV, SwiGLU epilogue
//   2. x_mid = x_in + act W_down^T                                              v3 GEMV + residual
//  ATTN (M = 1; its input is x_mid where FFN runs too, else x_in):
//   3. qkv   = (RMSNorm(x) * attn_norm) W_qkv^T                                 v3 GEMV
//   4. attn  = attention of the token over the cache: (Qwen3: per-head RMSNorm  decode_rows.metal, a task
//              of Q and K), RoPE, K and V into cache row pos                    per (partition, head group)
//   5. x_out = x + attn W_o^T                                                   v3 GEMV + residual
// FFN alone is kernels.blocks.ffn_block, ATTN alone attention_block, both a layer's FFN with the
// next layer's attention (layer_block): one launch a layer. Each phase is the kernel that runs it
// on its own (gemv/v3_rows.metal, attention/decode_rows.metal) and needs all of the phase before.
//
// Nothing waits on a threadgroup, only on work (gemv/seam.metal has the argument): the tickets of
// every phase but the last come from one counter in phase order, so every ticket a waiter needs
// was claimed before its own by a threadgroup already running, which finishes it without waiting
// on anything later; the last phase takes no tickets (nothing waits after it): threadgroup g runs
// its group g once the queue is empty. This needs running threadgroups to keep being scheduled
// while others spin, which NVIDIA GPUs give resident blocks; Metal promises no such thing, so
// kernels.blocks runs the phases as separate launches there (kernels.blocks.cross_group_waits).
// Split attention (LATHE_SPLIT, long contexts): the partitions of a head group are merged by the
// last of them to finish (LATHE_MERGE, decode_attention.metal), before it counts its task done.
//
// queue: uint32 [6 * QUEUE_STRIDE], zero before a launch and left zero after it: tickets claimed,
// phases 1-4 done, threadgroups out, each on a 256-byte line of its own. One queue (and one set
// of merge counters) per launch in flight, and launches that share one ordered by their data.
// Constants: v3's QTYPE, M, R (even with FFN), NSIMD, P, XCHUNK, and each GEMV's K: K_UP (d_model),
// K_DOWN (F), K_QKV (d_model), K_O (n_heads * D); with ATTN the attention's D, G, QS, BS (0), NEOX,
// FREQ_TABLE. Prelude: FFN, ATTN; with ATTN LATHE_PAGED 0, LATHE_ROPE 1, LATHE_SPLIT, LATHE_MERGE
// (= LATHE_SPLIT), LATHE_HEAD_NORM.
// Inputs (kernels.blocks names them): x_in, eps, block_dims (int32: threadgroups launched,
// attention tasks), queue; FFN: ffn_norm, w_gate_up ([gate; up]), up_dims (int32: 2F, d_model,
// tickets), w_down, down_dims (d_model, F, tickets); ATTN: attn_norm, w_qkv, qkv_dims, k_cache,
// v_cache ([Hkv, max_seq, D], written in place), pos, inv_freq, rope_scalars, dims
// (decode_attention's), scale, q_norm, k_norm (LATHE_HEAD_NORM), counters (split), w_o, o_dims.
// Outputs: FFN: act [M, F], x_mid [M, d_model]; ATTN: qkv, attn_out [1, Hq, D], x_out [1, d_model],
// part_out and part_ml (split).
#include "gemv/v3_tiles.metal"
#if ATTN
#include "attention/decode_tiles.metal"
#endif
constexpr uint QUEUE_STRIDE = 64;
threadgroup uint ticket;
const uint launched = uint(block_dims[0]);
// Tickets of phases 1-4 (zero where a half is off); the last phase present takes none.
#if FFN
const uint up_tickets = uint(up_dims[2]);
const uint down_tickets = ATTN ? uint(down_dims[2]) : 0u;
#else
const uint up_tickets = 0, down_tickets = 0;
#endif
#if ATTN
const uint qkv_tickets = uint(qkv_dims[2]);
const uint attn_tickets = uint(block_dims[1]);
#else
const uint qkv_tickets = 0, attn_tickets = 0;
#endif
const auto claimed = queue, groups_out = queue + 5 * QUEUE_STRIDE;
const auto up_done = queue + QUEUE_STRIDE, down_done = queue + 2 * QUEUE_STRIDE;
const auto qkv_done = queue + 3 * QUEUE_STRIDE, attn_done = queue + 4 * QUEUE_STRIDE;
#if FFN && ATTN
const auto x_attn = x_mid;  // the attention half's input and residual
#elif ATTN
const auto x_attn = x_in;
#endif

for (;;) {
  if (tid == 0) ticket = grid_ticket(claimed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint t = ticket;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // read by all before the next claim
  if (t >= up_tickets + down_tickets + qkv_tickets + attn_tickets) break;
  if (t < up_tickets) {
#if FFN
#define LATHE_PROLOGUE 1
#define LATHE_RESIDUAL 0
#define LATHE_EPILOGUE 1
    auto x = x_in;
    auto gamma = ffn_norm;
    auto w = w_gate_up;
    auto y = act;
    const uint group = t;
    {
      auto dims = up_dims;
      constexpr uint KR = K_UP;
#include "gemv/v3_rows.metal"
    }
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
#undef LATHE_EPILOGUE
    threadgroup_barrier(mem_flags::mem_device);  // this ticket's values of act are written
    if (tid == 0) grid_signal(up_done);
#endif
  } else if (t < up_tickets + down_tickets) {
#if FFN && ATTN
    if (tid == 0) grid_wait(up_done, up_tickets);
    threadgroup_barrier(mem_flags::mem_device);  // all of act is visible to the threadgroup
#define LATHE_PROLOGUE 0
#define LATHE_RESIDUAL 1
    auto residual = x_in;
    auto x = act;
    auto w = w_down;
    auto y = x_mid;
    const uint group = t - up_tickets;
    {
      auto dims = down_dims;
      constexpr uint KR = K_DOWN;
#include "gemv/v3_rows.metal"
    }
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
    threadgroup_barrier(mem_flags::mem_device);
    if (tid == 0) grid_signal(down_done);
#endif
  } else if (t < up_tickets + down_tickets + qkv_tickets) {
#if ATTN
    if (FFN) {
      if (tid == 0) grid_wait(down_done, down_tickets);
      threadgroup_barrier(mem_flags::mem_device);  // all of x_mid is visible
    }
#define LATHE_PROLOGUE 1
#define LATHE_RESIDUAL 0
    auto x = x_attn;
    auto gamma = attn_norm;
    auto w = w_qkv;
    auto y = qkv;
    const uint group = t - up_tickets - down_tickets;
    {
      auto dims = qkv_dims;
      constexpr uint KR = K_QKV;
#include "gemv/v3_rows.metal"
    }
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
    threadgroup_barrier(mem_flags::mem_device);  // this ticket's rows of qkv are written
    if (tid == 0) grid_signal(qkv_done);
#endif
  } else {
#if ATTN
    if (tid == 0) grid_wait(qkv_done, qkv_tickets);
    threadgroup_barrier(mem_flags::mem_device);  // all of qkv is visible
    const uint task = t - up_tickets - down_tickets - qkv_tickets;
    const uint head_groups = uint(dims[0]) * QS;  // tasks a partition: kv heads x QS
    const uint part = task / head_groups, hg = task % head_groups, b = 0;
    auto out = attn_out;
    {
#include "attention/decode_rows.metal"
    }
    threadgroup_barrier(mem_flags::mem_device);  // this head group's output (or partials) written
    if (tid == 0) grid_signal(attn_done);
#endif
  }
}

// The last phase: the output projection (ATTN), or the down projection (FFN alone).
{
  const uint group = threadgroup_position_in_grid.x;
#if ATTN
  if (group < uint(o_dims[2])) {
    if (tid == 0) grid_wait(attn_done, attn_tickets);
    threadgroup_barrier(mem_flags::mem_device);
#define LATHE_PROLOGUE 0
#define LATHE_RESIDUAL 1
    auto residual = x_attn;
    auto x = attn_out;
    auto w = w_o;
    auto y = x_out;
    auto dims = o_dims;
    constexpr uint KR = K_O;
#include "gemv/v3_rows.metal"
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
  }
#else
  if (group < uint(down_dims[2])) {
    if (tid == 0) grid_wait(up_done, up_tickets);
    threadgroup_barrier(mem_flags::mem_device);
#define LATHE_PROLOGUE 0
#define LATHE_RESIDUAL 1
    auto residual = x_in;
    auto x = act;
    auto w = w_down;
    auto y = x_mid;
    auto dims = down_dims;
    constexpr uint KR = K_DOWN;
#include "gemv/v3_rows.metal"
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
  }
#endif
}

// The last threadgroup out leaves the queue zero for the next launch (every other one has made
// its last claim and its last read of the done counts before it counts itself out).
if (tid == 0 && grid_signal(groups_out) == launched - 1) {
  grid_reset(claimed, 1);
  grid_reset(up_done, 1);
  grid_reset(down_done, 1);
  grid_reset(qkv_done, 1);
  grid_reset(attn_done, 1);
  grid_reset(groups_out, 1);
}
