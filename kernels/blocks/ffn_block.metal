// ffn_block: the FFN half of a decoder layer for 1..4 tokens, in one launch:
//   1. act   = silu(X' W_gate^T) * (X' W_up^T),  X' = RMSNorm(x_in) * ffn_norm
//              v3 GEMV with the SwiGLU epilogue over W = [gate; up] (gemv_v3.metal), claimed tickets
//   2. x_out = x_in + act W_down^T               v3 GEMV + residual, threadgroup g its group g
// Phase 2's threadgroups wait for every ticket of phase 1: the waits, their safety and where
// they may run are attention_block.metal's (the seam's ticket scheme).
// queue: uint32 [3 * QUEUE_STRIDE] (claimed, phase 1 done, threadgroups out), zero before a
// launch and left zero after it; one per launch in flight.
// Constants: v3's QTYPE, M, R (even), NSIMD, P, XCHUNK, K_UP (d_model), K_DOWN (F).
// Inputs: x_in [M, d_model], ffn_norm (half), eps, w_gate_up ([gate; up], 2F rows), up_dims (int32:
// 2F, d_model, tickets), w_down, down_dims (d_model, F, tickets), block_dims (threadgroups
// launched), queue. Outputs: act [M, F], x_out [M, d_model].
#include "gemv/v3_tiles.metal"
constexpr uint QUEUE_STRIDE = 64;
threadgroup uint ticket;
const uint launched = uint(block_dims[0]);
const uint up_tickets = uint(up_dims[2]);
const auto claimed = queue, up_done = queue + QUEUE_STRIDE, groups_out = queue + 2 * QUEUE_STRIDE;

for (;;) {
  if (tid == 0) ticket = grid_ticket(claimed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint group = ticket;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // read by all before the next claim
  if (group >= up_tickets) break;
  {
#define LATHE_PROLOGUE 1
#define LATHE_RESIDUAL 0
#define LATHE_EPILOGUE 1
    auto x = x_in;
    auto gamma = ffn_norm;
    auto w = w_gate_up;
    auto y = act;
    auto dims = up_dims;
    constexpr uint KR = K_UP;
#include "gemv/v3_rows.metal"
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
#undef LATHE_EPILOGUE
  }
  threadgroup_barrier(mem_flags::mem_device);  // this ticket's values of act are written
  if (tid == 0) grid_signal(up_done);
}

{
  const uint group = threadgroup_position_in_grid.x;
  if (group < uint(down_dims[2])) {
    if (tid == 0) grid_wait(up_done, up_tickets);
    threadgroup_barrier(mem_flags::mem_device);
#define LATHE_PROLOGUE 0
#define LATHE_RESIDUAL 1
    auto residual = x_in;
    auto x = act;
    auto w = w_down;
    auto y = x_out;
    auto dims = down_dims;
    constexpr uint KR = K_DOWN;
#include "gemv/v3_rows.metal"
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL
  }
}

if (tid == 0 && grid_signal(groups_out) == launched - 1) {
  grid_reset(claimed, 1);
  grid_reset(up_done, 1);
  grid_reset(groups_out, 1);
}
