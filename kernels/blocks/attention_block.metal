// attention_block: the attention half of a decoder layer for one decode token, in one launch
// (EdgeRunner's mega-kernel, on the seam's tickets):
//   1. qkv   = (RMSNorm(x_in) * attn_norm) W_qkv^T           v3 GEMV (gemv_v3.metal), claimed tickets
//   2. attn  = attention of the token over the cache          decode_rows.metal, claimed tickets:
//              (Qwen3: per-head RMSNorm of Q and K), RoPE,     one per (partition, head group); K and V
//              K and V written into cache row pos              written by the threadgroups that read the row
//   3. x_out = x_in + attn W_o^T                              v3 GEMV + residual, threadgroup g its group g
// Each phase needs all of the one before: a threadgroup holding a ticket of phase 2 waits until
// every ticket of phase 1 is done, and the threadgroups of phase 3 wait for all of phase 2.
// Nothing waits on a threadgroup, only on work (gemv/seam.metal has the argument): tickets come
// from one counter in phase order, so every ticket a waiter needs was claimed before its own by
// a threadgroup already running, which finishes it without waiting on anything later. Phase 3
// needs no tickets (nothing waits after it): a threadgroup enters it after the queue is empty.
// This needs running threadgroups to keep being scheduled while others spin, which NVIDIA GPUs
// give resident blocks; Metal promises no such thing, so kernels.blocks runs these phases as
// separate launches there (kernels.blocks.cross_group_waits).
//
// Split attention (LATHE_SPLIT, long contexts): the partitions of a head group are merged by the
// last of them to finish (LATHE_MERGE, decode_attention.metal), before it counts its ticket done.
//
// queue: uint32 [4 * QUEUE_STRIDE], zero before a launch and left zero after it: tickets claimed,
// phase 1 done, phase 2 done, threadgroups out, each on a 256-byte line of its own. One queue
// (and one set of merge counters) per launch in flight.
// Constants: v3's QTYPE, M (1), R, NSIMD, P, XCHUNK, K_QKV (d_model), K_O (n_heads * D); the
// attention's D, G, QS, BS (0), NEOX, FREQ_TABLE. Prelude: LATHE_PAGED 0, LATHE_ROPE 1,
// LATHE_SPLIT, LATHE_MERGE (= LATHE_SPLIT), LATHE_HEAD_NORM.
// Inputs: x_in [1, d_model], attn_norm (half), eps, w_qkv, qkv_dims (int32: N, K, tickets),
// k_cache, v_cache ([Hkv, max_seq, D], written in place), pos (int32[1]), inv_freq, rope_scalars,
// dims (decode_attention's), scale, q_norm, k_norm (f32[D]; read with LATHE_HEAD_NORM), counters
// (merge), w_o, o_dims (N, K, tickets), block_dims (threadgroups launched, attention tickets),
// queue. Outputs: qkv [1, (Hq + 2 Hkv) D], attn_out [1, Hq, D], x_out [1, d_model], part_out,
// part_ml (split partials; 1-element placeholders otherwise).
#include "gemv/v3_tiles.metal"
#include "attention/decode_tiles.metal"
constexpr uint QUEUE_STRIDE = 64;
threadgroup uint ticket;
const uint launched = uint(block_dims[0]);
const uint qkv_tickets = uint(qkv_dims[2]);
const uint attn_tickets = uint(block_dims[1]);
const uint head_groups = uint(dims[0]) * QS;  // threadgroups a partition: kv heads x QS
const auto claimed = queue, qkv_done = queue + QUEUE_STRIDE, attn_done = queue + 2 * QUEUE_STRIDE,
           groups_out = queue + 3 * QUEUE_STRIDE;

for (;;) {
  if (tid == 0) ticket = grid_ticket(claimed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint t = ticket;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // read by all before the next claim
  if (t >= qkv_tickets + attn_tickets) break;
  if (t < qkv_tickets) {
#define LATHE_PROLOGUE 1
#define LATHE_RESIDUAL 0
    auto x = x_in;
    auto gamma = attn_norm;
    auto w = w_qkv;
    auto y = qkv;
    const uint group = t;
    {
      auto dims = qkv_dims;
      constexpr uint KR = K_QKV;
#include "gemv/v3_rows.metal"
    }
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
    threadgroup_barrier(mem_flags::mem_device);  // this ticket's rows of qkv are written
    if (tid == 0) grid_signal(qkv_done);
  } else {
    if (tid == 0) grid_wait(qkv_done, qkv_tickets);
    threadgroup_barrier(mem_flags::mem_device);  // all of qkv is visible to the threadgroup
    const uint task = t - qkv_tickets;
    const uint part = task / head_groups, hg = task % head_groups, b = 0;
    auto out = attn_out;
    {
#include "attention/decode_rows.metal"
    }
    threadgroup_barrier(mem_flags::mem_device);  // this head group's output (or partials) written
    if (tid == 0) grid_signal(attn_done);
  }
}

{
  const uint group = threadgroup_position_in_grid.x;
  if (group < uint(o_dims[2])) {
    if (tid == 0) grid_wait(attn_done, attn_tickets);
    threadgroup_barrier(mem_flags::mem_device);
#define LATHE_PROLOGUE 0
#define LATHE_RESIDUAL 1
    auto residual = x_in;
    auto x = attn_out;
    auto w = w_o;
    auto y = x_out;
    auto dims = o_dims;
    constexpr uint KR = K_O;
#include "gemv/v3_rows.metal"
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
  }
}

// The last threadgroup out leaves the queue zero for the next launch (every other one has made
// its last claim and its last read of the done counts before it counts itself out).
if (tid == 0 && grid_signal(groups_out) == launched - 1) {
  grid_reset(claimed, 1);
  grid_reset(qkv_done, 1);
  grid_reset(attn_done, 1);
  grid_reset(groups_out, 1);
}
