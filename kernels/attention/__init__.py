"""Decode attention over KV caches (fp16 K/V, fp32 softmax), reference/attention.py's layouts.

- `paged_attention(q, k_cache, v_cache, block_table, context_lens, scale, version=)`: vLLM's
  paged cache; "v1" one threadgroup per (KV head, sequence) walking the whole context, "v2" the
  context split in partitions (of `partition` tokens, or as `auto_partition` sizes them), merged
  by the last threadgroup of each head group in the same launch (`counters=`: the launch site's
  merge_counters), or by a combine kernel (the attn_combine option).
- `flash_decode(q, k_cache, v_cache, lengths, scale)`: the contiguous head-major cache
  `[B, Hkv, max_seq, D]`, split in partitions and merged the same way (`split=False`: one
  threadgroup per head, as v1).
- `rope_flash_decode(qkv, k_cache, v_cache, pos, scale, n_heads=)`: one decode token's RoPE,
  KV-cache write and flash decode in one launch, from the fused QKV projection's output.
- `prefill_attention(q, k_cache, v_cache, pos, scale, block_table=)`: a prompt's causal
  attention over either cache.
- `reshape_and_cache(k, v, k_cache, v_cache, slots)`: new tokens into the paged caches, in place;
  returns the caches and an ordering token that readers take as `after=`.
- `visible_tokens(written, max_seq, overflow=)`: what a contiguous cache holds after `written`
  tokens (circular overflow, or an error).

One body (decode_attention.metal) serves all: the layout and the split are compile-time
switches. Query heads of a group share their threadgroup, so K and V are read once per group,
unless the grid is small (the attn_query_split option): then a group's query heads are split over threadgroups.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kernels import backends, native, options
from kernels.paged import BLOCK_SIZES, X
from kernels.paged import pool_shape as _pool
from kernels.runtime import KernelSpec, Launch, constant, depends, index, launch, reshaped, resident, table_constant

HEAD_DIMS = (64, 96, 128, 256)  # 96: Phi-3-mini's
# Tokens a threadgroup takes in the split kernels: by default as few as give the launch about
# SPLIT_GRID threadgroups, from one chunk (NSIMD * 32 tokens, a thread a token) up to
# PARTITION_MOST. The kernel walks its chunks one after another, each a chain of latencies, so a
# small grid of long partitions is slow (one decode sequence with few kv heads; measured in
# kernels/attention/NOTES.md). Batches and prompts, whose grids are large already, keep
# partitions of PARTITION_MOST: 1024 since K's copies run ahead across chunks (a mixed batch of 8
# at 32768, Llama-3's heads: 221.4 -> 214.0 us against 512 on the H200). The attn_partition
# option fixes it.
PARTITION_MOST = 1024
SPLIT_GRID = 512
# Launches in the MMA form (use_mma) aim at half as many: each threadgroup's chain is shorter, and
# partitions of two chunks (K's next copies in flight across them) and half the partials to merge
# beat one-chunk partitions (H200, Llama-3's heads at 8192: flash_decode 11.6 -> 9.8 us with
# attn_k_copy=row, paged_v2 9.5 -> 8.7; kernels/attention/NOTES.md).
SPLIT_GRID_MMA = 256
# Split only past this many tokens: below it a second launch (the combine) costs more than the
# partitions' parallelism gains (results/<device>/attention.csv). Checks pass split_from=0 to
# test the split.
SPLIT_FROM = 2048
CHUNK_MULTIPLE = 8  # partitions start on 8-token vectors (decode_attention.metal)
# A kv head's query heads are split over threadgroups (decode_attention.metal's QS, halving the
# heads a threadgroup takes while they divide) as long as the grid stays within this many
# threadgroups: at short contexts the kernel is a chain of latencies, and a grid of one
# threadgroup per kv head (Llama-3-8B: 8) leaves most SMs idle, while the extra reads of K and V
# are few and meet in the L2. The attn_query_split option sets the bound (auto: QUERY_SPLIT_MOST;
# the blocks' bound launches have their own rule, kernels.blocks.attention_query_split); 0 keeps a
# group in one threadgroup.
QUERY_SPLIT_MOST = 64
NSIMD = 4
MERGE_PARTS = 128  # partitions the in-launch merge takes (decode_rows.metal); more: the combine launch


def merge_loads(parts: int) -> int:
    """Partitions whose partials the in-launch merge loads at a time (decode_rows.metal's MLOADS):
    a power of two up to 16, never more than the launch's `parts` (its last round is shifted back
    to end at the last partition, so every load is in range without a clamp). ptxas keeps every
    decode kernel at its registers with 16 (Llama-3's contiguous one at 112 with K's two slots,
    128 with none; at e5dd20c, K in registers, it took 130 with 8 or more)."""
    _check_merged(parts)
    return min(16, 1 << (parts.bit_length() - 1))


def merge_lane(parts: int) -> int:
    """Partitions a lane of the in-launch merge weighs (decode_rows.metal's MLANE; its weights take
    G * 32 * MLANE floats of threadgroup memory): 2 up to 64 partitions, the form every merged
    launch had before the merge took more, then as few as hold `parts`. A long context that fills
    the GPU's threadgroups with partitions of two chunks (the 8B's 16384 tokens: 65 of 256 a kv
    head) needs more than 64."""
    _check_merged(parts)
    return max(2, -(-parts // 32))


def merge_splits(group: int, head_dim: int, nsimd: int, parts: int) -> int:
    """Runs a slot's partitions are split into in the in-launch merge (decode_rows.metal's MSPLIT):
    2 where the slots (4 values of a head's output each) take at most half the threadgroup's
    threads and there are at least 32 partitions (two runs of 16 loads or more), so the idle half
    takes the second run: Qwen3's 2 heads of 128 a threadgroup at 4096 tokens load 34 partitions
    in 2 rounds instead of 3. Else 1, and always 1 under attn_merge_split=off."""
    slots = group * head_dim // 4
    return 2 if options.get("attn_merge_split") and 2 * slots <= 32 * nsimd and parts >= 32 else 1


def merge_constants(group: int, head_dim: int, nsimd: int, parts: int) -> dict[str, int]:
    """The in-launch merge's constants (decode_rows.metal): MSPLIT, MLOADS for its shortest run,
    MLANE."""
    split = merge_splits(group, head_dim, nsimd, parts)
    return dict(MSPLIT=split, MLOADS=merge_loads(parts // split), MLANE=merge_lane(parts))


def merge_held(c: dict) -> int:
    """The partitions whose weights a merged launch's threadgroup memory holds, from its constants
    (32 a lane, MLANE lanes' worth): decode_threadgroup_bytes' `merge`."""
    return 32 * c["MLANE"]


def _check_merged(parts: int) -> None:
    if not 1 <= parts <= MERGE_PARTS:
        raise ValueError(f"the in-launch merge takes 1..{MERGE_PARTS} partitions, got {parts}")


COMBINE_PARTS = 64  # partitions combine.metal weighs at a time (its PB): their weights in threadgroup memory
_COMBINE = KernelSpec("lathe_attention_combine", "attention/combine.metal",
                      ("part_out", "part_ml", "dims"), ("out",), threadgroup_bytes=lambda c: 4 * COMBINE_PARTS)
_RESHAPE = KernelSpec("lathe_reshape_and_cache", "attention/reshape_and_cache.metal",
                      ("k", "v", "slots", "k_cache", "v_cache", "dims"), ("written",),
                      in_place=("k_cache", "v_cache"))


def _softcap_prelude(softcap: float) -> tuple[str, str]:
    """(name suffix, prelude line) of a softcap of the scores (Gemma 2's; 0: none): the value a
    float literal of the body, the name an identifier."""
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
    if not softcap:
        return "", "#define LATHE_SOFTCAP 0"
    return "_softcap" + repr(float(softcap)).replace(".", "p").replace("-", "m"), f"#define LATHE_SOFTCAP {float(softcap)!r}f"


@functools.cache
def _spec(paged: bool, split: bool, rope: bool = False, merge: bool = False, head_norm: bool = False,
          window: int = 0, softcap: float = 0.0) -> KernelSpec:
    """One decode_attention.metal family; `merge` (split only): the last threadgroup of a head
    group merges the partitions in the same launch (counters in, out out); `head_norm` (rope
    only): Qwen3's per-head RMSNorm of Q and K before they turn; `window` (> 0): a sliding-window
    layer's, each query over its last `window` positions only; `softcap` (> 0): scores c * tanh(s / c)."""
    capped, cap_line = _softcap_prelude(softcap)
    if rope:  # the QKV rows and their positions in place of q, lens and the ordering token
        inputs = ("qkv", "k_cache", "v_cache", "pos") + (("table",) if paged else ()) + (
            "inv_freq", "rope_scalars", "dims", "scale") + (("q_norm", "k_norm") if head_norm else ())
    else:
        inputs = ("q", "k_cache", "v_cache", "lens") + (("table",) if paged else ()) + (
            "dims", "scale", "after")
    merge = merge and split
    outputs = ("part_out", "part_ml") if split else ("out",)
    if merge:
        inputs, outputs = (*inputs, "counters"), (*outputs, "out")
    head_norm = head_norm and rope
    name = (f"lathe_{'paged' if paged else 'contiguous'}_{'norm_' if head_norm else ''}{'rope_' if rope else ''}"
            f"attention_{'split' if split else 'whole'}{'_merge' if merge else ''}{f'_window{window}' if window else ''}"
            f"{capped}")
    return KernelSpec(name, "attention/decode_attention.metal", inputs, outputs,
                      prelude=f"#define LATHE_PAGED {int(paged)}\n#define LATHE_SPLIT {int(split)}\n"
                              f"#define LATHE_ROPE {int(rope)}\n#define LATHE_MERGE {int(merge)}\n"
                              f"#define LATHE_HEAD_NORM {int(head_norm)}\n#define LATHE_WINDOW {int(window)}\n{cap_line}"
                              # a batch's QKV rows, query b's a row after query b - 1's (paged_rope_attention)
                              + ("\n#define LATHE_QKV_ROW ((n_heads + 2u * n_kv) * uint(D))" if rope and paged else ""),
                      threadgroup_bytes=functools.partial(_decode_threadgroup_bytes, head_norm=head_norm,
                                                          merge=merge),
                      in_place=("k_cache", "v_cache") if rope else ())  # rope: the new K and V rows


def decode_threadgroup_bytes(group: int, head_dim: int, nsimd: int, head_norm: bool, merge: int,
                             slots: int = 0, mma: bool = False) -> int:
    """Threadgroup memory of a decode attention launch (decode_tiles.metal) for `group` query
    heads a threadgroup: Q and the output sums of each head, a chunk's scores (a thread a token),
    the softmax's running max, sum and rescale; the heads' norms (Qwen3's), each partition's
    weight where the launch merges its `merge` partitions (0: it merges none), K's `slots` (a
    round of KG 16-byte vectors for each thread, and 16 bytes), and with `mma` Q in fp16 (8 rows
    of D + 8 halves)."""
    chunk = nsimd * 32
    words = 2 * group * head_dim + group * chunk + 3 * group
    words += (group + 1) if head_norm else 0
    words += (1 + group * 32 * merge_lane(merge)) if merge else 0
    return 4 * words + slots * k_slot_bytes(head_dim, nsimd) + 16 + 2 * (8 * (head_dim + 8) if mma else 1)


def k_slot_bytes(head_dim: int, nsimd: int) -> int:
    """Bytes of one of decode attention's K slots: a round of KG 16-byte vectors a thread."""
    dv = head_dim // 8  # decode_tiles.metal's KG: K's 16-byte vectors a round
    kg = 8 if dv % 8 == 0 else 6 if dv % 6 == 0 else dv
    return 16 * kg * nsimd * 32


def _decode_threadgroup_bytes(c: dict, head_norm: bool, merge: bool) -> int:
    return decode_threadgroup_bytes(c["G"], c["D"], c["NSIMD"], head_norm, merge_held(c) if merge else 0,
                                    c.get("KSLOTS", 0),
                                    bool(c.get("MMA", 0)))


def merge_counters(slots: int) -> mx.array:
    """Counters for one launch site of the split attention's in-launch merge (the attn_combine
    option's last_group): zero, on the device, at least batch * query heads of them. A launch
    leaves them zero; two launches in flight at once must not share them (give each site its
    own, as the decode loop gives each layer)."""
    return resident(mx.zeros((slots,), mx.uint32))


_STREAM_COUNTERS: dict[tuple[int, str], mx.array] = {}


def _stream_counters(slots: int) -> mx.array:
    """Counters for a call that brings none (one outside the decode loop): its stream's, kept.
    A launch leaves them zero and the launches of one stream run one after another, so calls
    reuse them; a fresh array a call cost an allocation and a memset in every call's wall time."""
    key = (slots, str(mx.default_stream(mx.default_device())))
    if key not in _STREAM_COUNTERS:
        _STREAM_COUNTERS[key] = merge_counters(slots)
    return _STREAM_COUNTERS[key]


def _check_counters(counters: mx.array, need: int) -> None:
    if not isinstance(counters, mx.array) or counters.dtype != mx.uint32 or counters.ndim != 1 \
            or counters.size < need:
        raise ValueError(f"counters must be uint32 [>= {need}] (merge_counters), got "
                         f"{getattr(counters, 'dtype', type(counters))} {getattr(counters, 'shape', '')}")


def _ints(values: tuple[int, ...]) -> mx.array:
    return constant(tuple(int(x) for x in values))


def _device_ints(values: np.ndarray) -> mx.array:
    """Host ints for a kernel: one value (a decode step's length or slot) as a view into the
    resident index table, so that per-token values neither write managed memory nor wait."""
    return index(int(values[0])) if len(values) == 1 else table_constant(values)


def _scale(scale: float) -> mx.array:
    return constant((scale,), mx.float32)


def _no_order() -> mx.array:
    return constant((0,), mx.uint32)


def _fp16(name: str, a: mx.array) -> None:
    if not isinstance(a, mx.array) or a.dtype != mx.float16:
        raise ValueError(f"{name} must be float16, got {getattr(a, 'dtype', type(a))}")


def _host_ints(name: str, a, shape_len: int) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != shape_len or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a {shape_len}-D integer array, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64)


def _check_q(q: mx.array, n_kv: int, head_dim: int) -> tuple[int, int]:
    _fp16("q", q)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if q.ndim != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [B, n_heads, {head_dim}], got {tuple(q.shape)}")
    batch, n_heads = q.shape[0], q.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}")
    return batch, n_heads // n_kv


@functools.cache
def auto_partition(longest: int, grids: int, split_grid: int = SPLIT_GRID) -> int:
    """Partition length for a split launch over `longest` tokens with `grids` (kv head, sequence)
    pairs: about `split_grid` threadgroups in all, whole chunks, at most PARTITION_MOST tokens."""
    chunk = NSIMD * 32
    partitions = max(1, split_grid // max(1, grids))  # wanted per (kv head, sequence)
    tokens = -(-longest // partitions)
    return min(max(-(-tokens // chunk) * chunk, chunk), PARTITION_MOST)  # whole chunks


def query_split(group: int, threadgroups: int, most: int | None = None) -> int:
    """Threadgroups that share a kv head's `group` query heads (decode_attention.metal's QS): the
    largest divisor of the group for which the grid of `threadgroups` (one per kv head, partition
    and sequence) times it stays within `most` (the attn_query_split option when not given). Any
    divisor, not only powers of two: Qwen2.5-7B's 7 query heads a kv head would otherwise stay in
    one threadgroup of 7 heads, 4 threadgroups a layer, whose registers (G * D / 32 sums a lane)
    then set the megafused launch's for every phase (kernels/loop/NOTES.md)."""
    if most is None:
        most = options.get("attn_query_split")
    most = QUERY_SPLIT_MOST if most is None else most
    return max(qs for qs in range(1, group + 1) if group % qs == 0 and (qs == 1 or threadgroups * qs <= most))


# 8-token V vectors a SIMD group takes of a chunk of NSIMD * 32 tokens (decode_tiles.metal's VPS): 4
V_VECTORS = NSIMD * 32 // 8 // NSIMD


def v_prefetch(head_dim: int, threadgroups: int) -> int:
    """V vectors a SIMD group loads at a time (decode_tiles.metal's VPF): the attn_v_prefetch
    option, else by the launch's regime. A grid of fewer than SPLIT_GRID threadgroups (a short
    context, or a split one that fits the SMs) is a chain of latencies: all of a chunk's V
    vectors come in with its K loads where D <= 128 (one at a time for D = 256, whose registers
    allow no more). A larger grid streams: then 256 / D at a time, which keeps a threadgroup of
    Llama-3's heads (G = 4, D = 128) within 128 registers, 4 threadgroups an SM instead of 3:
    one wave for an 8192-token decode (kernels/attention/NOTES.md)."""
    chosen = options.get("attn_v_prefetch")
    if chosen is None:
        most = V_VECTORS if head_dim <= 128 else 1
        return most if threadgroups < SPLIT_GRID else max(1, min(most, 256 // head_dim))
    if chosen not in (1, 2, 4) or V_VECTORS % chosen:
        raise ValueError(f"attn_v_prefetch must be 1, 2 or 4 (dividing {V_VECTORS}), got {chosen}")
    return chosen


def split_grid(mma: int) -> int:
    """Threadgroups a split launch's automatic partitions aim at: the attn_split_grid option, else
    SPLIT_GRID_MMA for the MMA form, SPLIT_GRID otherwise."""
    return options.get("attn_split_grid") or (SPLIT_GRID_MMA if mma else SPLIT_GRID)


def k_slots(group: int, head_dim: int, head_norm: bool, merge: int) -> int:
    """K's slots of threadgroup memory (decode_tiles.metal's KSLOTS): the attn_k_slots option, else
    2 where the backend's threadgroup memory holds them (CUDA's 48 KiB, as launched: with the
    next round's copies in flight during this one's products), else 1 (Metal's 32 KiB), else 0
    (also where even that is past the budget: the launch then splits the group to fit)."""
    chosen = options.get("attn_k_slots")
    if chosen is not None:
        if chosen not in (0, 1, 2):
            raise ValueError(f"attn_k_slots must be 0, 1 or 2, got {chosen}")
        return chosen
    return slots_that_fit(2, group, head_dim, NSIMD, head_norm, merge, False, backends.threadgroup_memory())


def slots_that_fit(most: int, group: int, head_dim: int, nsimd: int, head_norm: bool, merge: int,
                   mma: bool, budget: int) -> int:
    """The most K slots, at most `most`, with which decode attention's threadgroup arrays stay
    within `budget` bytes (0 where not even one does)."""
    return next((n for n in range(most, 0, -1)
                 if decode_threadgroup_bytes(group, head_dim, nsimd, head_norm, merge, n, mma) <= budget), 0)


def mma_form(group: int, head_dim: int, nsimd: int = NSIMD) -> bool:
    """Whether the MMA form takes these heads: at most 8 a threadgroup (a fragment's rows), D a
    power of two from 32 (SIMD groups split D and the tokens evenly) and at most 32 a SIMD group
    (its V words in registers)."""
    return group <= 8 and head_dim >= 32 and head_dim & (head_dim - 1) == 0 and head_dim <= 32 * nsimd


def use_mma(group: int, head_dim: int, slots: int, head_norm: bool, merge: int) -> int:
    """Scores and P.V on SIMD-group matrices (decode_tiles.metal's USE_MMA): the attn_mma option.
    The form needs K in threadgroup memory (slots > 0), at most 8 heads a threadgroup (a fragment's
    rows), D a multiple of 32 and at most 128 (its V words in registers), and Q's fp16 copy within
    the backend's threadgroup memory. auto takes it from 4 heads a threadgroup on (Llama-3's heads:
    their FMAs a token were the longest link of the chain; kernels/attention/NOTES.md), on wherever
    it can, off never."""
    chosen = options.get("attn_mma")
    can = (slots > 0 and mma_form(group, head_dim)
           and decode_threadgroup_bytes(group, head_dim, NSIMD, head_norm, merge, slots, True)
           <= backends.threadgroup_memory())
    return int(can and (chosen == "on" or (chosen == "auto" and group >= 4)))


def k_copy_rows(mma: int, paged: bool, threadgroups: int) -> int:
    """K copied by whole rows (decode_tiles.metal's K_BY_ROW): the attn_k_copy option; auto takes it
    for the MMA form over the contiguous cache in grids of at most SPLIT_GRID_MMA threadgroups. Its
    copies ask for whole sectors where a lane a token asks for halves, for ~25 more registers (3
    threadgroups an SM instead of 4): past two an SM the token copies keep more in flight."""
    chosen = options.get("attn_k_copy")
    if not mma or paged or chosen == "token":
        return 0
    return int(chosen == "row" or threadgroups <= SPLIT_GRID_MMA)


def _run(paged: bool, split: bool, q: mx.array, k_cache: mx.array, v_cache: mx.array,
         lens: mx.array, longest: int, table: mx.array | None, rows: int, n_kv: int, group: int,
         scale: float, partition: int | None, block_size: int, after: mx.array | None,
         shared_cache: bool = False, split_from: int = SPLIT_FROM, rope: tuple | None = None,
         counters: mx.array | None = None, window: int = 0,
                 softcap: float = 0.0) -> mx.array:
    """lens: int32[B] on the device; longest: the most any of them can be (it sizes the grid).
    rope: (inv_freq, rope_scalars, constants, head norms: (q_norm, k_norm) or ()) of
    rope_flash_decode, whose q is the QKV row.
    counters: the launch site's (merge_counters) where a split launch merges in itself (the
    attn_combine option); the stream's own (_stream_counters) when not given.
    window (> 0): each query sees its last `window` positions: the grid covers at most that many
    tokens (and the few the kernel's aligned start adds), wherever they lie."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")
    if window:
        longest = min(longest, window + CHUNK_MULTIPLE - 1)
    # rope: a token a sequence, q their QKV rows, lens their positions; the contiguous cache
    # [1, Hkv, S, D], the paged pool's V [blocks, Hkv, D, BS]
    batch, n_heads, head_dim = ((lens.shape[0], n_kv * group, v_cache.shape[2] if paged else k_cache.shape[-1])
                                if rope is not None else q.shape)
    head_norm = bool(rope and rope[3])
    if partition is None:  # the attn_partition option, else sized for the grid (and the form)
        partition = options.get("attn_partition") or auto_partition(longest, n_kv * batch, split_grid(
            use_mma(group, head_dim, k_slots(group, head_dim, head_norm, 0), head_norm, 0)))
    if partition % CHUNK_MULTIPLE or partition <= 0:
        raise ValueError(f"partition must be a positive multiple of {CHUNK_MULTIPLE}, got {partition}")
    # One partition holds every context, or contexts are short: the unsplit body writes the output
    # itself and the combine launch is saved (vLLM's dispatcher picks v1 over v2 the same way).
    split = split and longest > partition and longest > split_from
    parts = -(-longest // partition) if split else 1
    dims = _ints((n_kv, rows, partition, parts, 0 if shared_cache else 1))
    qs = query_split(group, n_kv * parts * batch)
    combine = options.get("attn_combine")
    if combine == "auto":  # merged in the launch, but in the fused loop's RoPE launch (NOTES.md)
        combine = "launch" if rope is not None else "last_group"
    merge = split and combine == "last_group" and parts <= MERGE_PARTS
    merged = parts if merge else 0  # (the partitions whose weights its threadgroup memory holds)
    # Where a threadgroup's share of the group's heads would not fit the backend's threadgroup
    # memory (Metal's 32 KiB; a wide group, as multi-query heads make), fewer heads a threadgroup
    while group % (2 * qs) == 0 and decode_threadgroup_bytes(group // qs, head_dim, NSIMD, head_norm, merged) \
            > backends.threadgroup_memory():
        qs *= 2
    constants = dict(D=head_dim, G=group // qs, QS=qs, NSIMD=NSIMD, BS=block_size,
                     VPREF=v_prefetch(head_dim, parts * n_kv * qs * batch),
                     KSLOTS=k_slots(group // qs, head_dim, head_norm, merged))
    constants["MMA"] = use_mma(group // qs, head_dim, constants["KSLOTS"], head_norm, merged)
    constants["KROW"] = k_copy_rows(constants["MMA"], paged, parts * n_kv * qs * batch)
    if rope is not None:  # q is the QKV rows, lens the positions (rope_flash_decode, paged_rope_attention)
        inputs = [q, k_cache, v_cache, lens, *((table,) if paged else ()), *rope[:2], dims, _scale(float(scale)),
                  *rope[3]]
        constants.update(rope[2])
    else:
        inputs = [q, k_cache, v_cache, lens]
        if paged:
            inputs.append(table)
        inputs += [dims, _scale(float(scale)), _no_order() if after is None else after]
    outputs = ([((batch, n_heads, parts, head_dim), mx.float32), ((batch, n_heads, parts, 2), mx.float32)]
               if split else [((batch, n_heads, head_dim), mx.float16)])
    if merge:
        constants.update(merge_constants(group // qs, head_dim, NSIMD, parts))
        if counters is None:
            counters = _stream_counters(batch * n_heads)
        _check_counters(counters, batch * n_kv * qs)
        inputs.append(counters)
        outputs.append(((batch, n_heads, head_dim), mx.float16))
    res = launch(Launch(_spec(paged, split, rope is not None, merge, head_norm, window, softcap), inputs, outputs,
                        (parts * 32 * NSIMD, n_kv * qs, batch), (32 * NSIMD, 1, 1), constants))
    if not split or merge:
        return res[-1]
    (out,) = launch(Launch(_COMBINE, [res[0], res[1], _ints((n_heads, parts))],
                           [((batch, n_heads, head_dim), mx.float16)],
                           (head_dim, n_heads, batch), (min(head_dim, 256), 1, 1), dict(D=head_dim)))
    return out


def paged_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, block_table,
                    context_lens: Sequence[int] | mx.array, scale: float, *, version: str = "v2",
                    partition: int | None = None, after: mx.array | None = None,
                    split_from: int = SPLIT_FROM, counters: mx.array | None = None, window: int = 0,
                 softcap: float = 0.0) -> mx.array:
    """out[B, Hq, D] for one query token per sequence over vLLM's paged caches (k_cache
    [blocks, Hkv, D/8, BS, 8], v_cache [blocks, Hkv, D, BS]); block_table [B, max_blocks] and
    context_lens [B] are checked on the host before the launch. v2 splits contexts longer than
    split_from into partitions of `partition` tokens; shorter ones take v1's single launch.

    The device form (a compiled decode step, whose position is an array): context_lens int32[B]
    and block_table int32[B, max_blocks] both on the device. Only shapes and dtypes can be checked
    then: the caller checked the table's entries once, when it made it; the kernel clamps a
    length to the table's blocks, and the grid is sized for them. `window` (> 0): each sequence
    attends to its last `window` tokens only (flash_decode's)."""
    if version not in ("v1", "v2"):
        raise ValueError(f"version must be 'v1' or 'v2', got {version!r}")
    blocks, n_kv, head_dim, block_size = _pool(k_cache, v_cache)
    batch, group = _check_q(q, n_kv, head_dim)
    if isinstance(context_lens, mx.array):
        if not isinstance(block_table, mx.array) or block_table.dtype != mx.int32 or block_table.ndim != 2 \
                or block_table.shape[0] != batch:
            raise ValueError(f"with device context_lens, block_table must be int32[{batch}, max_blocks] "
                             f"on the device, got {getattr(block_table, 'dtype', type(block_table))}")
        if context_lens.dtype != mx.int32 or tuple(context_lens.shape) != (batch,):
            raise ValueError(f"device context_lens must be int32[{batch}], got "
                             f"{context_lens.dtype}{tuple(context_lens.shape)}")
        rows = block_table.shape[1]
        return _run(True, version == "v2", q, k_cache, v_cache, context_lens, rows * block_size,
                    block_table, rows, n_kv, group, scale, partition, block_size, after,
                    split_from=split_from, counters=counters, window=window, softcap=softcap)
    table = _host_ints("block_table", block_table, 2)
    lens = _host_ints("context_lens", context_lens, 1)
    if table.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(f"block_table and context_lens need {batch} rows (one per sequence)")
    if lens.min() < 1 or lens.max() > table.shape[1] * block_size:
        raise ValueError(f"context lengths must be in 1..{table.shape[1] * block_size} (the blocks "
                         f"given: {table.shape[1]} of {block_size}), got {lens.min()}..{lens.max()}")
    _rows_inside(table, lens, block_size, blocks)
    table_dev = block_table if isinstance(block_table, mx.array) else table_constant(table)
    if table_dev.dtype != mx.int32:
        table_dev = table_dev.astype(mx.int32)
    return _run(True, version == "v2", q, k_cache, v_cache, _device_ints(lens), int(lens.max()),
                table_dev, table.shape[1], n_kv, group, scale, partition, block_size, after,
                split_from=split_from, counters=counters, window=window, softcap=softcap)


def _rows_inside(table: np.ndarray, lens, block_size: int, blocks: int) -> None:
    """Each host table row's blocks that its sequence's lens[b] tokens use point inside the
    pool's `blocks`, or a ValueError names the row."""
    for b, n in enumerate(lens):
        used = table[b, : -(-int(n) // block_size)]
        if used.min() < 0 or used.max() >= blocks:
            raise ValueError(f"block_table row {b} points outside the {blocks} blocks of the pool")


def visible_tokens(written: int, max_seq: int, overflow: bool = True) -> int:
    """Tokens a contiguous cache of max_seq slots holds after `written` were stored: all of them,
    or past max_seq the last max_seq (circular overflow), or an error if overflow is off."""
    if written < 1:
        raise ValueError(f"at least one token must be in the cache, got {written}")
    if written > max_seq and not overflow:
        raise ValueError(f"{written} tokens do not fit a cache of {max_seq} (overflow is off)")
    return min(written, max_seq)


def flash_decode(q: mx.array, k_cache: mx.array, v_cache: mx.array, lengths: Sequence[int],
                 scale: float, *, split: bool = True, partition: int | None = None,
                 after: mx.array | None = None, split_from: int = SPLIT_FROM,
                 counters: mx.array | None = None, window: int = 0,
                 softcap: float = 0.0) -> mx.array:
    """out[B, Hq, D] over the contiguous head-major caches [B, Hkv, max_seq, D]; lengths[b] is
    the number of slots sequence b attends to (see visible_tokens). Host lengths are checked;
    `lengths` may also be int32[B] on the device (a compiled decode step, whose position is an
    array): then nothing can be checked before the launch, the caller keeps them in 1..max_seq,
    and the grid is sized for max_seq (partitions past a sequence's end exit at once).
    `window` (> 0, a sliding-window layer): sequence b attends to its last `window` slots only,
    lengths[b] - window .. lengths[b] - 1 (the cache holds every position; Gemma's local layers).
    `softcap` (> 0, Gemma 2): each score s becomes c * tanh(s / c) before the softmax."""
    _fp16("k_cache", k_cache)
    _fp16("v_cache", v_cache)
    if k_cache.ndim != 4 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"k_cache and v_cache must both be [B, Hkv, max_seq, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    cache_batch, n_kv, max_seq, head_dim = k_cache.shape
    batch, group = _check_q(q, n_kv, head_dim)
    if cache_batch != batch:
        raise ValueError(f"the caches hold {cache_batch} sequences, q has {batch}")
    if isinstance(lengths, mx.array):
        if lengths.dtype != mx.int32 or tuple(lengths.shape) != (batch,):
            raise ValueError(f"device lengths must be int32[{batch}], got {lengths.dtype}{tuple(lengths.shape)}")
        lens_dev, longest = lengths, max_seq
    else:
        lens = _host_ints("lengths", lengths, 1)
        if lens.shape[0] != batch or lens.min() < 1 or lens.max() > max_seq:
            raise ValueError(f"lengths must be {batch} values in 1..{max_seq}, got {lens.tolist()}")
        lens_dev, longest = _device_ints(lens), int(lens.max())
    return _run(False, split, q, k_cache, v_cache, lens_dev, longest, None, max_seq, n_kv, group,
                scale, partition, 0, after, split_from=split_from, counters=counters, window=window,
                softcap=softcap)


def rope_flash_decode(qkv: mx.array, k_cache: mx.array, v_cache: mx.array, pos: int | mx.array,
                      scale: float, *, n_heads: int, theta: float = 10000.0, freq_scale: float = 1.0,
                      inv_freq: mx.array | None = None, neox: bool = False, split: bool = True,
                      partition: int | None = None, split_from: int = SPLIT_FROM,
                      counters: mx.array | None = None, q_norm: mx.array | None = None,
                      k_norm: mx.array | None = None, eps: float | None = None, window: int = 0,
                      softcap: float = 0.0) -> tuple[mx.array, mx.array, mx.array]:
    """One decode token's RoPE, KV-cache write and attention in one launch (a launch a layer
    fewer than kernels.rope.rope_qkv_write then flash_decode: the same cache rows; the rotated
    query stays in fp32 instead of being rounded to fp16 in between): qkv[(n_heads + 2
    n_kv) * D] (or [1, ...]) is the fused projection's unrotated output, the head-major caches
    [n_kv, max_seq, D] take K (rotated) and V at row pos, and the token attends to rows
    0..pos. Returns (out[1, n_heads, D], k_cache, v_cache), the caches ordered after the write.
    pos: an int (checked here) or int32[1] on the device (a compiled step: a position past the
    cache writes nothing and attends to the rows held; the caller keeps it in range).
    q_norm, k_norm (f32[D]) and eps: Qwen3's per-head RMSNorm of each query head and of K before
    they turn (kernels.rope.head_norm_rope_neox_kv_write's, in this launch). `window` (> 0): the
    token attends to its last `window` rows only (flash_decode's)."""
    from kernels import rope as rope_kernels

    n_kv, max_seq, head_dim = _head_major(k_cache, v_cache)
    width, rope = _rope_form(qkv, n_heads, n_kv, head_dim, theta, freq_scale, inv_freq, neox, q_norm, k_norm, eps)
    if qkv.size != width or qkv.ndim > 2 or (qkv.ndim == 2 and qkv.shape[0] != 1):
        raise ValueError(f"qkv must be one token's [(n_heads + 2 * n_kv) * D = {width}], got {tuple(qkv.shape)}")
    pos_arr = rope_kernels._pos_array(pos, 1, max_seq)
    longest = pos + 1 if isinstance(pos, int) else max_seq  # sizes the grid, as flash_decode's
    # the caches as a batch of one, written in place (the new token's K and V rows)
    k_one = reshaped(k_cache, (1, *k_cache.shape), "rope_flash_decode: k_cache")
    v_one = reshaped(v_cache, (1, *v_cache.shape), "rope_flash_decode: v_cache")
    out = _run(False, split, qkv.reshape(-1), k_one, v_one, pos_arr, longest, None,
               max_seq, n_kv, n_heads // n_kv, scale, partition, 0, None, split_from=split_from,
               rope=rope, counters=counters, window=window, softcap=softcap)
    k_cache, v_cache = depends([k_cache, v_cache], [out])
    return out, k_cache, v_cache


def paged_rope_attention(qkv: mx.array, k_cache: mx.array, v_cache: mx.array, block_table, positions,
                         scale: float, *, n_heads: int, theta: float = 10000.0, freq_scale: float = 1.0,
                         inv_freq: mx.array | None = None, neox: bool = False, partition: int | None = None,
                         split_from: int = SPLIT_FROM, counters: mx.array | None = None,
                         q_norm: mx.array | None = None, k_norm: mx.array | None = None, eps: float | None = None,
                         window: int = 0, softcap: float = 0.0) -> tuple[mx.array, mx.array, mx.array]:
    """A decode token a sequence over vLLM's paged pool, its RoPE, K/V write and attention in one
    launch (a launch a layer fewer than kernels.rope.rope_paged_qkv_write then paged_attention):
    qkv[B, (n_heads + 2 n_kv) * D] the fused projection's unrotated rows, sequence b's new token at
    positions[b], its K (rotated) and V written at offset positions[b] % BS of block
    block_table[b, positions[b] / BS], and attending to its tokens 0..positions[b]. The threadgroup
    whose tokens hold the new row writes it before it reads it (rope_flash_decode's form, the
    one token_block's batch form runs). Returns (out[B, n_heads, D], k_cache, v_cache), the pools
    ordered after the writes. positions and block_table: host ints (checked here) or int32[B] and
    int32[B, max_blocks] on the device (a compiled step: the caller checked the table's entries;
    a position past the table's blocks is clamped, as paged_attention's lengths). q_norm, k_norm
    (f32[D]) and eps: Qwen3's per-head RMSNorm of Q and K before they turn."""
    blocks, n_kv, head_dim, block_size = _pool(k_cache, v_cache)
    width, rope = _rope_form(qkv, n_heads, n_kv, head_dim, theta, freq_scale, inv_freq, neox, q_norm, k_norm, eps)
    if qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [B, (n_heads + 2 * n_kv) * D = {width}], got {tuple(qkv.shape)}")
    batch = qkv.shape[0]
    if isinstance(block_table, mx.array):
        if block_table.dtype != mx.int32 or block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be int32[{batch}, max_blocks], got {block_table.dtype}"
                             f"{tuple(block_table.shape)}")
        table = None
    else:
        table = _host_ints("block_table", block_table, 2)
        if table.shape[0] != batch:
            raise ValueError(f"block_table must be [{batch}, max_blocks] (a row a sequence), got {table.shape}")
    rows = block_table.shape[1] if table is None else table.shape[1]
    if isinstance(positions, mx.array):
        if positions.dtype != mx.int32 or tuple(positions.shape) != (batch,):
            raise ValueError(f"positions must be int32[{batch}], got {positions.dtype}{tuple(positions.shape)}")
        pos, longest = positions, rows * block_size
    else:
        host = _host_ints("positions", positions, 1)
        if host.shape != (batch,) or host.min() < 0 or host.max() >= rows * block_size:
            raise ValueError(f"positions must be {batch} positions within the table's {rows * block_size} tokens, "
                             f"got {host.tolist()}")
        pos, longest = _device_ints(host), int(host.max()) + 1
        if table is not None:  # the blocks each sequence's tokens up to its new one use
            _rows_inside(table, host + 1, block_size, blocks)
    if table is not None:
        if isinstance(positions, mx.array) and (table.min() < 0 or table.max() >= blocks):
            raise ValueError(f"block_table points outside the {blocks} blocks of the pool")
        block_table = table_constant(table)
        if block_table.dtype != mx.int32:
            block_table = block_table.astype(mx.int32)
    out = _run(True, True, qkv, k_cache, v_cache, pos, longest, block_table, rows, n_kv, n_heads // n_kv, scale,
               partition, block_size, None, split_from=split_from, rope=rope, counters=counters, window=window,
               softcap=softcap)
    k_cache, v_cache = depends([k_cache, v_cache], [out])
    return out, k_cache, v_cache


def _rope_form(qkv: mx.array, n_heads: int, n_kv: int, head_dim: int, theta: float, freq_scale: float,
               inv_freq: mx.array | None, neox: bool, q_norm: mx.array | None, k_norm: mx.array | None,
               eps: float | None) -> tuple[int, tuple]:
    """What the rope form's launches share, checked: (a QKV row's values, _run's `rope` argument:
    the frequency table, the scalars theta, freq_scale and eps, the constants, the head norms)."""
    from kernels import rope as rope_kernels

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if n_heads < n_kv or n_heads % n_kv:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of the {n_kv} kv heads")
    _fp16("qkv", qkv)
    norms = _head_norms(q_norm, k_norm, eps, head_dim)
    scalars = constant((float(theta), float(freq_scale), float(eps or 0.0)), mx.float32)
    return ((n_heads + 2 * n_kv) * head_dim,
            (rope_kernels._table(head_dim, theta, inv_freq), scalars, dict(NEOX=neox, FREQ_TABLE=True), norms))


def _head_major(k_cache: mx.array, v_cache: mx.array) -> tuple[int, int, int]:
    """(Hkv, max_seq, D) of the contiguous head-major fp16 caches, checked."""
    _fp16("k_cache", k_cache)
    _fp16("v_cache", v_cache)
    if k_cache.ndim != 3 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"k_cache and v_cache must both be [Hkv, max_seq, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    return tuple(k_cache.shape)


def _head_norms(q_norm: mx.array | None, k_norm: mx.array | None, eps: float | None,
                head_dim: int) -> tuple[mx.array, ...]:
    """(q_norm, k_norm) checked, or () without head norms."""
    given = [a is not None for a in (q_norm, k_norm, eps)]
    if not any(given):
        return ()
    if not all(given):
        raise ValueError("head norms take q_norm, k_norm and eps together")
    for name, a in (("q_norm", q_norm), ("k_norm", k_norm)):
        if not isinstance(a, mx.array) or a.dtype != mx.float32 or a.shape != (head_dim,):
            raise ValueError(f"{name} must be float32 [{head_dim}], got {getattr(a, 'dtype', type(a))} "
                             f"{getattr(a, 'shape', '')}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    return (q_norm, k_norm)


def prefill_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, pos: int, scale: float,
                      *, block_table=None, split: bool = True, partition: int | None = None,
                      after: mx.array | None = None, split_from: int = SPLIT_FROM,
                      counters: mx.array | None = None, kernel: str | None = None,
                      window: int = 0, softcap: float = 0.0) -> mx.array:
    """Causal attention of a prompt's T query tokens q[T, Hq, D], at positions pos .. pos+T-1,
    over a cache that already holds their K and V: token i sees tokens 0 .. pos+i. The cache is
    the contiguous head-major [Hkv, max_seq, D] (or [1, Hkv, max_seq, D]), or with `block_table`
    (one sequence's blocks, host ints) vLLM's paged pool as paged_attention takes it.

    `kernel` (default: the attn_prefill option): "tiled", prefill_attention.metal (query tiles
    against K/V tiles in threadgroup memory on SIMD-group matrices, online softmax); "wgmma",
    prefill_wgmma.cu (the same schedule on Hopper's warpgroup MMA: a native CUDA kernel, sm_90a
    only, D 64 or 128); "auto", wgmma where it runs, else tiled; "decode",
    the decode kernel with one query per token, every query on the same cache (K and V come
    through the L2 cache for the other queries; split, partition, split_from and counters apply
    to it only). `window` (> 0, a sliding-window layer): token i sees tokens pos+i-window+1 ..
    pos+i only (tiled and decode; wgmma does not take it, so auto runs tiled). `softcap` (> 0):
    scores c * tanh(s / c) before the mask (Gemma 2's; tiled and decode, as the window)."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")
    _fp16("k_cache", k_cache)
    _fp16("v_cache", v_cache)
    if block_table is not None:
        _, n_kv, head_dim, block_size = _pool(k_cache, v_cache)
        table = _host_ints("block_table", block_table, 1)
        rows, capacity = table.shape[0], table.shape[0] * block_size
    else:
        if k_cache.ndim == 4 and k_cache.shape[0] == 1:
            k_cache, v_cache = k_cache[0], v_cache[0]
        if k_cache.ndim != 3 or tuple(v_cache.shape) != tuple(k_cache.shape):
            raise ValueError(f"k_cache and v_cache must both be [Hkv, max_seq, D], got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        n_kv, capacity, head_dim = k_cache.shape
        rows, block_size = capacity, 0
        k_cache, v_cache = k_cache[None], v_cache[None]
    tokens, group = _check_q(q, n_kv, head_dim)
    if pos < 0 or pos + tokens > capacity:
        raise ValueError(f"positions {pos}..{pos + tokens - 1} do not fit the cache of {capacity}")
    table_dev = None
    if block_table is not None:
        used = table[: -(-(pos + tokens) // block_size)]
        if used.min() < 0 or used.max() >= k_cache.shape[0]:
            raise ValueError(f"block_table points outside the {k_cache.shape[0]} blocks of the pool")
        table_dev = table_constant(table.reshape(1, -1))
    kernel = options.get("attn_prefill") if kernel is None else kernel
    if kernel in ("auto", "wgmma"):
        reason = ("a sliding window" if window else "a softcap of the scores" if softcap
                  else wgmma_prefill_unavailable(head_dim, block_size))
        if not reason:
            return _prefill_wgmma(q, k_cache, v_cache, table_dev, rows, n_kv, pos, scale, block_size, after)
        if kernel == "wgmma":
            raise ValueError(f"prefill kernel 'wgmma': {reason}")
        kernel = "tiled"  # auto, where wgmma cannot run
    if kernel == "tiled":
        return _prefill_tiled(q, k_cache, v_cache, table_dev, rows, n_kv, pos, scale, block_size, after, window,
                              softcap)
    if kernel != "decode":
        raise ValueError(f"kernel must be 'auto', 'wgmma', 'tiled' or 'decode', got {kernel!r}")
    lens = np.arange(pos + 1, pos + tokens + 1)
    return _run(block_table is not None, split, q, k_cache, v_cache, _device_ints(lens), int(lens.max()),
                table_dev, rows, n_kv, group, scale, partition, block_size, after, shared_cache=True,
                split_from=split_from, counters=counters, window=window, softcap=softcap)


PREFILL_NSIMD = 4  # SIMD groups of a tiled prefill threadgroup


def prefill_tiles(head_dim: int, paged: bool = False) -> tuple[int, int]:
    """(RB, BK) of prefill_attention.metal: 8-row blocks a SIMD group and keys a tile. Two row
    blocks share each K and V load up to D = 128; D = 256 keeps one (its output sums alone take
    64 registers a lane) and tiles of 16 keys (the two stages then fit 48 KiB). Where the
    backend gives less threadgroup memory (Metal's 32 KiB: kernels.backends), tiles of fewer
    keys, down to 8."""
    rb, bk = (1, 16) if head_dim == 256 else (2, 32)
    while bk > 8 and prefill_threadgroup_bytes(head_dim, rb, bk, paged) > backends.threadgroup_memory():
        bk //= 2
    return rb, bk


def prefill_threadgroup_bytes(head_dim: int, rb: int, bk: int, paged: bool) -> int:
    """Threadgroup memory of a tiled prefill launch (prefill_attention.metal's TG_HALVES): two
    stages of a K and a V tile, the first also holding Q's staging before the loop."""
    kst = head_dim + 8
    vst, v_rows = (bk + 8, head_dim) if paged else (head_dim + 8, bk)
    stage = bk * kst + v_rows * vst
    return 2 * (stage + max(stage, PREFILL_NSIMD * rb * 8 * kst))


@functools.cache
def _prefill_spec(paged: bool, window: int = 0, softcap: float = 0.0) -> KernelSpec:
    inputs = ("q", "k_cache", "v_cache") + (("table",) if paged else ()) + ("dims", "scale", "after")
    capped, cap_line = _softcap_prelude(softcap)
    return KernelSpec(f"lathe_{'paged' if paged else 'contiguous'}_prefill_tiled{f'_window{window}' if window else ''}"
                      f"{capped}", "attention/prefill_attention.metal", inputs, ("out",),
                      prelude=f"#define LATHE_PAGED {int(paged)}\n#define LATHE_WINDOW {int(window)}\n{cap_line}",
                      threadgroup_bytes=lambda c: prefill_threadgroup_bytes(c["D"], c["RB"], c["BK"], paged))


def _prefill_tiled(q: mx.array, k_cache: mx.array, v_cache: mx.array, table: mx.array | None,
                   rows: int, n_kv: int, pos: int, scale: float, block_size: int,
                   after: mx.array | None, window: int = 0, softcap: float = 0.0) -> mx.array:
    tokens, n_heads, head_dim = q.shape
    rb, bk = prefill_tiles(head_dim, table is not None)
    tiles = -(-tokens // (PREFILL_NSIMD * rb * 8))
    inputs = [q, k_cache, v_cache] + ([table.reshape(-1)] if table is not None else []) + [
        _ints((n_kv, rows, tokens, pos, n_heads, tiles)), _scale(float(scale)),
        _no_order() if after is None else after]
    (out,) = launch(Launch(_prefill_spec(table is not None, window, softcap), inputs, [((tokens, n_heads, head_dim), mx.float16)],
                           (tiles * 32 * PREFILL_NSIMD, n_heads, 1), (32 * PREFILL_NSIMD, 1, 1),
                           dict(D=head_dim, RB=rb, BK=bk, NSIMD=PREFILL_NSIMD, BS=block_size)))
    return out


WGMMA_PREFILL = "attention/prefill_wgmma.cu"
# prefill_wgmma.cu's BM, BN, THREADS and STAGES
WGMMA_ROWS, WGMMA_KEYS, WGMMA_THREADS, WGMMA_STAGES = 128, 128, 256, 3


def wgmma_prefill_unavailable(head_dim: int, block_size: int) -> str:
    """Why the wgmma prefill kernel cannot take this launch ('' where it can)."""
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (it takes 64 or 128)"
    if block_size % 8 or (block_size and WGMMA_KEYS % block_size):
        return f"block size {block_size} (paged blocks of 8, 16, 32, 64 or 128 keys: whole 8-key pieces, whole blocks a tile)"
    return native.unavailable_reason()


def wgmma_prefill_bytes(head_dim: int) -> int:
    """prefill_wgmma.cu's SMEM_BYTES: Q's tile, the stages of a K and a V tile, two mbarriers a
    stage, 1 KiB to align the base."""
    return (WGMMA_ROWS + WGMMA_STAGES * 2 * WGMMA_KEYS) * head_dim * 2 + 2 * WGMMA_STAGES * 8 + 1024


def _float_bits(x: float) -> int:
    """x's fp32 bits as a signed int (a kernel parameter the kernel reads back as a float)."""
    return int(np.array(x, np.float32).view(np.int32))


def _prefill_wgmma(q: mx.array, k_cache: mx.array, v_cache: mx.array, table: mx.array | None,
                   rows: int, n_kv: int, pos: int, scale: float, block_size: int,
                   after: mx.array | None) -> mx.array:
    tokens, n_heads, head_dim = q.shape
    tiles = -(-tokens // WGMMA_ROWS)
    # the sizes and the scale go as kernel parameters: a CTA's first copies then wait on no load
    # (the contiguous cache's `table` is any array: not read)
    inputs = [q, k_cache, v_cache, q if table is None else table.reshape(-1),
              _no_order() if after is None else after]
    constants = dict(HEAD_DIM=head_dim, PAGED=int(table is not None), BLOCK_SIZE=block_size)
    (out,) = native.launch(WGMMA_PREFILL, "lathe_prefill_wgmma", constants, inputs,
                           [((tokens, n_heads, head_dim), mx.float16)],
                           (n_heads * WGMMA_THREADS, tiles, 1), (WGMMA_THREADS, 1, 1),
                           wgmma_prefill_bytes(head_dim),
                           scalars=(*map(int, (n_kv, rows, tokens, pos, n_heads, tiles)), _float_bits(scale)))
    return out


def rope_prefill_unavailable(tokens: int, head_dim: int, window: int = 0, softcap: float = 0.0) -> str:
    """Why rope_prefill_attention cannot take a prompt in one launch ('' where it can): it is the
    wgmma kernel's ROPE form, one query tile of a contiguous cache."""
    if tokens > WGMMA_ROWS:
        return f"{tokens} tokens (one query tile: up to {WGMMA_ROWS})"
    if window or softcap:
        return "a sliding window" if window else "a softcap of the scores"
    return wgmma_prefill_unavailable(head_dim, 0)


def rope_prefill_attention(qkv: mx.array, k_cache: mx.array, v_cache: mx.array, pos: int, scale: float, *,
                           n_heads: int, theta: float = 10000.0, freq_scale: float = 1.0,
                           inv_freq: mx.array | None = None, neox: bool = False, q_norm: mx.array | None = None,
                           k_norm: mx.array | None = None, eps: float | None = None,
                           after: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """A short prompt's RoPE (q_norm, k_norm, eps: Qwen3's per-head RMSNorm before it), KV-cache
    write and causal attention in one launch (a launch a layer fewer than kernels.rope's
    rope_qkv_write or head_norm_rope_neox_qkv_write, then prefill_attention; the rotated queries
    go to the tensor cores as the fp16 they would have been written as): qkv[T, (n_heads + 2
    n_kv) * D] is the fused projection's unrotated output of T tokens at positions pos ..
    pos+T-1, the head-major caches [n_kv, max_seq, D] take their K (rotated) and V rows, and token
    i attends to rows 0 .. pos+i. Returns (out[T, n_heads, D], k_cache, v_cache), the caches
    ordered after the write. Where rope_prefill_unavailable names a reason (past one query tile,
    no sm_90a), a ValueError before any launch: the caller runs the two launches."""
    n_kv, max_seq, head_dim = _head_major(k_cache, v_cache)
    width, (table, _, _, norms) = _rope_form(qkv, n_heads, n_kv, head_dim, theta, freq_scale, inv_freq, neox,
                                             q_norm, k_norm, eps)
    if qkv.ndim != 2 or qkv.shape[1] != width or qkv.shape[0] < 1:
        raise ValueError(f"qkv must be [T, (n_heads + 2 * n_kv) * D = {width}], got {tuple(qkv.shape)}")
    tokens = qkv.shape[0]
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)):
        raise ValueError(f"pos must be a host int, got {type(pos).__name__}")
    if pos < 0 or pos + tokens > max_seq:
        raise ValueError(f"positions {pos}..{pos + tokens - 1} do not fit the cache of {max_seq}")
    reason = rope_prefill_unavailable(tokens, head_dim)
    if reason:
        raise ValueError(f"rope_prefill_attention: {reason}")
    # written in place: the caches as the kernel's [1, Hkv, S, D]
    k_one = reshaped(k_cache, (1, *k_cache.shape), "rope_prefill_attention: k_cache")
    v_one = reshaped(v_cache, (1, *v_cache.shape), "rope_prefill_attention: v_cache")
    q_w, k_w = norms if norms else (table, table)  # (not read without HEAD_NORM)
    constants = dict(HEAD_DIM=head_dim, PAGED=0, BLOCK_SIZE=0, ROPE=1, NEOX=int(neox), HEAD_NORM=int(bool(norms)))
    inputs = [qkv, k_one, v_one, qkv, _no_order() if after is None else after, table, q_w, k_w]
    (out,) = native.launch(WGMMA_PREFILL, "lathe_prefill_wgmma", constants, inputs,
                           [((tokens, n_heads, head_dim), mx.float16)],
                           (n_heads * WGMMA_THREADS, 1, 1), (WGMMA_THREADS, 1, 1), wgmma_prefill_bytes(head_dim),
                           scalars=(n_kv, max_seq, tokens, int(pos), n_heads, 1, _float_bits(scale),
                                    _float_bits(freq_scale), _float_bits(eps or 0.0)))
    k_cache, v_cache = depends([k_cache, v_cache], [out])
    return out, k_cache, v_cache


def reshape_and_cache(k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
                      slots) -> tuple[mx.array, mx.array, mx.array]:
    """Tokens' k, v [T, Hkv, D] into the paged caches at `slots` (block * BS + offset; -1 skips a
    padding token; host ints, checked, or int32[T] on the device), in place. Returns (k_cache, v_cache, written): the caches wrapped by
    mx.depends on the ordering token, and the token for GPU readers (`after=`)."""
    for name, a in (("k", k), ("v", v)):
        _fp16(name, a)
    blocks, n_kv, head_dim, block_size = _pool(k_cache, v_cache)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if k.ndim != 3 or tuple(k.shape[1:]) != (n_kv, head_dim) or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must be [T, {n_kv}, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
    tokens = k.shape[0]
    if isinstance(slots, mx.array):  # device slots (a compiled step): the kernel drops any outside the pool
        if slots.dtype != mx.int32 or tuple(slots.shape) != (tokens,):
            raise ValueError(f"device slots must be int32[{tokens}], got {slots.dtype}{tuple(slots.shape)}")
        slot_dev = slots
    else:
        slot_arr = _host_ints("slots", slots, 1)
        if slot_arr.shape[0] != tokens:
            raise ValueError(f"{tokens} tokens but {slot_arr.shape[0]} slots")
        if slot_arr.max(initial=-1) >= blocks * block_size:
            raise ValueError(f"slots must be below {blocks * block_size} (the pool), got {slot_arr.max()}")
        slot_dev = _device_ints(slot_arr)
    (written,) = launch(Launch(_RESHAPE, [k, v, slot_dev, k_cache, v_cache,
                                          _ints((tokens, n_kv, blocks * block_size))], [((1,), mx.uint32)],
                               (head_dim // X, n_kv, tokens), (head_dim // X, 1, 1),
                               dict(D=head_dim, BS=block_size)))
    return depends(k_cache, [written]), depends(v_cache, [written]), written
