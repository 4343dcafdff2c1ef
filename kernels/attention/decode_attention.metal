// Decode attention: one query token per sequence against its cached K and V (fp16), fp32 softmax
// and sums, grouped-query: threadgroup (partition, y, sequence b) serves the G query heads
// y*G .. y*G+G-1 of kv head h = y / QS, so K and V are read once per G query heads. QS = 1:
// a threadgroup takes all of its kv head's query heads; QS > 1 splits them over QS threadgroups,
// which read the same K and V (from the L2 when they run together): at short contexts the
// kernel is a chain of latencies, and Llama-3's 8 kv heads as 8 threadgroups left 124 of the
// H200's 132 SMs idle.
//
// The cache layout is a switch (LATHE_PAGED, set by the prelude):
//  0  contiguous, head-major k/v_cache[B, Hkv, S, D]; token t in slot t;
//  1  paged as vLLM: k_cache[blocks, Hkv, D/8, BS, 8], v_cache[blocks, Hkv, D, BS], token t of
//     sequence b in block table[b, t / BS] at offset t % BS.
// LATHE_SPLIT 0: one threadgroup walks all the context and writes out[B, Hq, D] (paged v1).
// LATHE_SPLIT 1: threadgroup p takes tokens [p * PART, (p + 1) * PART) and writes its normalized
// partial output, max and sum (part_out[B, Hq, P, D], part_ml[B, Hq, P, 2]); combine.metal
// merges them in a launch of its own (paged v2, flash decode), or, with LATHE_MERGE 1, the last
// of a head group's P threadgroups to finish merges them into out[B, Hq, D] in this launch:
// each counts itself in counters[b, y] (a release) once its partials are written, and the one
// that counts last (an acquire) reads all P partials (at most 64) and merges them with
// combine.metal's weighting, worked out in parallel, and sets the count back to zero for the
// next launch. Nothing waits on another threadgroup, so no launch size can hang on
// either GPU; a launch needs counters of its own, zero, while it runs.
// Tokens go in chunks of CH: scores for the chunk into threadgroup memory (a thread a token,
// 16-byte K loads, a row's loads issued together), the running max and sum updated once per
// chunk (online softmax), then P.V with SIMD groups taking 8-token vectors in turn, each lane
// owning D / 32 output rows (`dim` below); the SIMD groups' sums meet at the end. A SIMD group's
// V loads for its vectors of the chunk are issued at the chunk's start, with the K loads (all of
// them for D <= 128: LOAD_V_GROUP). At decode's short contexts the kernel is a chain of memory
// latencies, not a stream: every loop issues all of its loads before it uses one. Tokens past
// the context are never loaded into a sum: a V vector that straddles the end has its extra lanes
// replaced by zero, not multiplied by it (unused cache slots may hold anything, NaN included).
// LATHE_ROPE 1 (contiguous, one sequence, one new token): RoPE and the KV-cache write ride in
// this kernel, saving the launch of rope_kv_write a layer. q is then the unrotated QKV row of
// the token (Q heads, K heads, V heads: the fused projection's output) at position pos: each
// threadgroup rotates its G query heads into q_s, and the one whose tokens include pos rotates
// K and copies V of its kv head into cache row pos before any of its threads reads that row
// (its K and V come back through the cache, rounded to fp16 as every other row's; with QS > 1
// each of the QS threadgroups writes the same bytes). The context is pos + 1 tokens. (The blocks'
// token_block runs this form over B queries of the paged pool too: query b at pos[b], its QKV row
// LATHE_QKV_ROW values after query b - 1's, its new row written at its slot through its table.)
// Constants: D, G, QS, NSIMD, BS (paged block size; 0 contiguous), VPREF (V vectors a SIMD group
// loads at a time, the attn_v_prefetch option), KSLOTS (k_slots: K's slots of threadgroup memory),
// MMA (use_mma: 0 or 1), KROW (the attn_k_copy option's row: 1), MLOADS, MLANE and MSPLIT
// (LATHE_MERGE: partitions the merge loads at a time, weighs a lane, and runs a slot's
// partitions split into: merge_constants); with LATHE_ROPE also NEOX and FREQ_TABLE
// (rope_kv_write.metal's). Prelude: LATHE_PAGED, LATHE_SPLIT, LATHE_ROPE, LATHE_MERGE (split only;
// adds the input counters, uint32[B * Hkv * QS], and the output out).
// Inputs: q[B, Hq, D], k_cache, v_cache, lens (int32[B]), table (int32[B, MAXB]; paged),
//   dims (int32: Hkv, S or MAXB, PART, P, cache sequence per query: 1, or 0 for a prompt's
//   tokens over one cache), scale (float[1]), after (ordering token, not read). LATHE_ROPE:
//   qkv[(Hq + 2 Hkv) * D] in place of q, pos (int32[1]) in place of lens and after, inv_freq
//   (f32[D/2]) and rope_scalars (f32: theta, freq_scale, eps). LATHE_HEAD_NORM 1 (with LATHE_ROPE:
//   Qwen3): each query head and the K head are RMS-normed with q_norm / k_norm (f32[D]) before
//   they turn (the head norms of head_norm_rope_kv_write.metal, the query kept in fp32).
#define LATHE_V_PREFETCH VPREF  // V vectors loaded at a time (decode_tiles.metal's VPF)
#define LATHE_K_SLOTS KSLOTS  // K through threadgroup memory (decode_tiles.metal)
#define LATHE_MMA MMA  // scores and P.V on SIMD-group matrices (decode_tiles.metal)
#define LATHE_K_ROWS KROW  // K copied by rows (decode_tiles.metal's K_BY_ROW)
constexpr uint NT = NSIMD * 32;
const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
#include "attention/decode_tiles.metal"
{
  const uint part = threadgroup_position_in_grid.x;
  const uint hg = threadgroup_position_in_grid.y;  // query heads hg*G .. hg*G+G-1
  const uint b = threadgroup_position_in_grid.z;
#include "attention/decode_rows.metal"
}
