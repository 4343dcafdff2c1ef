// The seam between two blocks of a decoder layer, in one launch: GEMV A, whose output is the
// residual stream, then GEMV B over RMSNorm of that output (v2 GEMVs, gemv_v2.metal):
//   a_y = residual + W_a X'       X' = a_x (PROLOGUE_A 0: attention's output into W_o), or
//                                 silu(gate) * up of a_x = [gate | up] (2: the FFN's down)
//   b_y = (RMSNorm(a_y) * gamma) W_b^T    (the next block's gate+up, QKV, or the output head)
// Every row of b_y needs all of a_y, which a threadgroup of B can only read once all of A is
// written: the two were separate launches, each costing the host a kernel node (about 12-17 us
// in MLX, kernels/loop/NOTES.md). Here the threadgroups wait for each other in the kernel.
//
// A wait between threadgroups is safe only if the ones waited on can run: a launch larger
// than what fits on the GPU at once (or sharing it) would deadlock on a plain grid barrier.
// So nothing waits on a threadgroup, only on work: GEMV A's threadgroups (a_dims[2] of them,
// as gemv_v2 would launch) are tickets that the launched threadgroups (a_dims[3]) claim from
// `queue` one at a time. A threadgroup claims A tickets until none are left, then waits for
// all of them to be done: every one was claimed by a threadgroup already running, which
// finishes it without waiting on anything. GEMV B's threadgroups (b_dims[2], at most as many
// as launched) need no tickets, as nothing waits after them: threadgroup g is B's g. (A loop
// over B's threadgroups cost 13 registers, a third of the threadgroups an SM. With B claimed too,
// a seam ran 3-5 us longer on the H200 than its two GEMVs launched apart; suspected: every
// threadgroup leaves the wait at once and their claims on one counter queue up.)
//
// GEMV B's first weights need nothing of A: with PREFETCH, threadgroup g issues them (v2_rows's
// step 0) before it waits, so that they are on their way while A's last rows are computed and
// its count reaches the waiting threadgroups (two launches cannot overlap so; PREFETCH 0 waits
// first, for comparison).
//
// queue: uint32 [3 * QUEUE_STRIDE], zero before the first launch and left zero after each (the
// last threadgroup out resets it): A tickets claimed, A tickets done, threadgroups out, each
// counter in a 256-byte line of its own (QUEUE_STRIDE words apart: atomics on one line are
// served one after another). One queue per launch in flight:
// two launches running at once on one queue would mix their counts.
// Inputs: a_x [M, K_a] (PROLOGUE_A 2: [M, 2 K_a]), a_w, a_dims (int32: N_a, K_a, A tickets,
// threadgroups launched), residual [M, N_a], gamma [N_a], eps, b_w, b_dims (N_b, K_b = N_a,
// B tickets), queue. Outputs a_y [M, N_a], b_y [M, N_b]. Constants as gemv_v2's, shared by both,
// and PREFETCH.
// SEAM_V3 1 (the prelude): the two are v3 GEMVs (gemv_v3.metal) over repacked weights, with
// v3's constants (QTYPE, M, R, NSIMD, P, XCHUNK) and each GEMV's K: K_A, and K_B = N_a, and
// ROW_PASSES (v3_rows' GEMV_ROW_PASSES: the gemv_row_passes option).
#if SEAM_V3
#define GEMV_ROW_PASSES ROW_PASSES
#include "gemv/v3_tiles.metal"
#else
#include "gemv/v2_tiles.metal"
#endif
constexpr uint QUEUE_STRIDE = 64;
threadgroup uint ticket;
const uint launched = uint(a_dims[3]);
const auto claimed = queue, done = queue + QUEUE_STRIDE, out = queue + 2 * QUEUE_STRIDE;

#define LATHE_PROLOGUE PROLOGUE_A
#define LATHE_RESIDUAL 1
for (;;) {
  if (tid == 0) ticket = grid_ticket(claimed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint group = ticket;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // read by all before the next claim
  if (group >= uint(a_dims[2])) break;
  {
    auto x = a_x;
    auto w = a_w;
    auto dims = a_dims;
    auto y = a_y;
#if SEAM_V3
    constexpr uint KR = K_A, RR = R, PR = P, QR = QTYPE;
#include "gemv/v3_rows.metal"
#else
#include "gemv/v2_rows.metal"
#endif
  }
  threadgroup_barrier(mem_flags::mem_device);  // this ticket's rows of a_y are written
  if (tid == 0) grid_signal(done);
}
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL

// The wait for all of A: past it a_y is written and visible to the whole threadgroup (thread 0's
// acquire, then the barrier).
#define SEAM_WAIT                                   \
  if (tid == 0) {                                   \
    grid_wait(done, uint(a_dims[2]));               \
  }                                                 \
  threadgroup_barrier(mem_flags::mem_device);

#define LATHE_PROLOGUE 1
#define LATHE_RESIDUAL 0
#define GEMV_BEFORE_X if (PREFETCH) { SEAM_WAIT }  // the rows: B's first weights are in flight
{
  const uint group = threadgroup_position_in_grid.x;
  if (!PREFETCH || group >= uint(b_dims[2])) { SEAM_WAIT }  // (no rows of B: nothing to issue)
  if (group < uint(b_dims[2])) {
    auto x = a_y;
    auto w = b_w;
    auto dims = b_dims;
    auto y = b_y;
#if SEAM_V3
    constexpr uint KR = K_B, RR = R, PR = P, QR = QTYPE;
#include "gemv/v3_rows.metal"
#else
#include "gemv/v2_rows.metal"
#endif
  }
}
#undef GEMV_BEFORE_X
#undef LATHE_PROLOGUE
#undef LATHE_RESIDUAL

// The last threadgroup out leaves the queue zero for the next launch (every other one has made
// its last claim and its last read of `done` before it counts itself out).
if (tid == 0 && grid_signal(out) == launched - 1) {
  grid_reset(claimed, 1);
  grid_reset(done, 1);
  grid_reset(out, 1);
}
