"""Decode attention: argument checks and the reference (CPU), every check case (GPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import attention as at
from kernels import options
from reference import attention as ref

H, KV, D, BS, NB = 8, 2, 64, 16, 4


def q16(b=1, h=H, d=D):
    return mx.zeros((b, h, d), mx.float16)


def pools(nb=NB, kv=KV, d=D, bs=BS, dtype=mx.float16):
    return mx.zeros((nb, kv, d // 8, bs, 8), dtype), mx.zeros((nb, kv, d, bs), dtype)


def paged(**kw):
    args = dict(q=q16(), caches=pools(), table=[[0, 1]], lens=[20], scale=0.125)
    args.update(kw)
    k, v = args["caches"]
    return lambda: at.paged_attention(args["q"], k, v, args["table"], args["lens"], args["scale"])


def qkv16(b=1, h=H, kv=KV, d=D):
    return mx.zeros((b, (h + 2 * kv) * d), mx.float16)


def paged_rope(**kw):
    args = dict(qkv=qkv16(), caches=pools(), table=[[0, 1]], positions=[19], scale=0.125, n_heads=H)
    args.update(kw)
    k, v = args.pop("caches")
    return lambda: at.paged_rope_attention(args.pop("qkv"), k, v, args.pop("table"), args.pop("positions"),
                                           args.pop("scale"), **args)


BAD = [
    (paged_rope(table=[[0, 7]]), "row 0 points outside the 4 blocks"),
    (paged_rope(positions=[32]), "within the table's 32 tokens"),
    (paged_rope(positions=[-1]), "within the table's"),
    (paged_rope(positions=[1, 2]), "within the table's"),
    (paged_rope(qkv=qkv16(kv=1)), r"qkv must be \[B, \(n_heads \+ 2 \* n_kv\) \* D = 768\]"),
    (paged_rope(qkv=qkv16(b=2)), r"block_table must be \[2, max_blocks\] \(a row a sequence\)"),
    (paged_rope(n_heads=7), "multiple of the 2 kv heads"),
    (paged_rope(qkv=mx.zeros((1, (H + 2 * KV) * D), mx.float32)), "float16"),
    (paged_rope(caches=pools(d=48), qkv=qkv16(d=48)), "head_dim must be one of"),
    (paged_rope(table=mx.array([[0, 1]], dtype=mx.int32), positions=mx.array([3], dtype=mx.uint32)),
     r"positions must be int32\[1\]"),
    (paged_rope(table=mx.array([0, 1], dtype=mx.int32)), r"block_table must be int32\[1, max_blocks\]"),
    (paged_rope(q_norm=mx.ones((D,))), "head norms take q_norm, k_norm and eps together"),
    (paged(table=[[0, 7]]), "outside the 4 blocks"),
    (paged(table=[[0, -1]]), "outside"),
    (paged(lens=[33]), r"context lengths must be in 1..32"),
    (paged(lens=[0]), "context lengths"),
    (paged(q=q16(h=7)), "not a multiple"),
    (paged(q=q16(d=48), caches=pools(d=48)), "head_dim must be one of"),
    (paged(caches=pools(dtype=mx.float32)), "float16"),
    (paged(q=mx.zeros((1, H, D), mx.float32)), "float16"),
    (paged(caches=pools(bs=8)), "block size"),
    (paged(table=[[0, 1], [2, 3]]), "one per sequence"),
    (lambda: at.flash_decode(q16(), mx.zeros((1, KV, 32, D), mx.float16),
                             mx.zeros((1, KV, 32, D), mx.float16), [33], 0.1), "1..32"),
    (lambda: at.flash_decode(q16(), mx.zeros((1, KV, 32, D), mx.float16),
                             mx.zeros((1, KV, 16, D), mx.float16), [3], 0.1), "must both be"),
    (lambda: at.visible_tokens(40, 32, overflow=False), "overflow is off"),
    (lambda: at.flash_decode(q16(), mx.zeros((1, KV, 32, D), mx.float16),
                             mx.zeros((1, KV, 32, D), mx.float16), [3], 0.1, partition=12), "partition"),
    (lambda: at.reshape_and_cache(mx.zeros((2, KV, D), mx.float16), mx.zeros((2, KV, D), mx.float16),
                                  *pools(), [0, NB * BS]), "below 64"),
    (lambda: at.reshape_and_cache(mx.zeros((2, KV, D), mx.float16), mx.zeros((2, KV, D), mx.float16),
                                  *pools(), [0]), "2 tokens but 1 slots"),
    (lambda: at.reshape_and_cache(mx.zeros((2, KV, D), mx.float16), mx.zeros((2, KV, D), mx.float16),
                                  *pools(), mx.array([0], dtype=mx.int32)), r"int32\[2\]"),
    (paged(lens=mx.array([20], dtype=mx.int32)), "block_table must be int32"),  # device lens, host table
    (paged(lens=mx.array([20.0]), table=mx.array([[0, 1]], dtype=mx.int32)), "context_lens must be int32"),
    (lambda: at.prefill_attention(mx.zeros((3, H, D), mx.float16), *pools(), 30, 0.1, block_table=[0, 1]),
     r"do not fit the cache of 32"),
    (lambda: at.prefill_attention(mx.zeros((3, H, D), mx.float16), *pools(), 0, 0.1, block_table=[9]),
     "outside the 4 blocks"),
    (lambda: at.prefill_attention(mx.zeros((3, H, D), mx.float16), mx.zeros((KV, 32, D), mx.float16),
                                  mx.zeros((KV, 32, D), mx.float16), 0, 0.1, block_table=[0]), "k_cache must be"),
]


@pytest.mark.parametrize("call, message", BAD)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_visible_tokens_overflow():
    assert at.visible_tokens(10, 32) == 10
    assert at.visible_tokens(40, 32) == 32


def test_reference_paged_layout_round_trip():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((37, KV, D))
    v = rng.standard_normal((37, KV, D))
    kp = np.full((5, KV, D // 8, BS, 8), np.nan)
    vp = np.full((5, KV, D, BS), np.nan)
    table = np.array([3, 0, 4])
    slots = table[np.arange(37) // BS] * BS + np.arange(37) % BS
    ref.reshape_and_cache(kp, vp, k, v, slots)
    kk, vv = ref.paged_tokens(kp, vp, table, 37)
    assert np.array_equal(kk, k) and np.array_equal(vv, v)
    assert np.isnan(kp[1]).all() and np.isnan(vp[2]).all()  # untouched blocks


@pytest.mark.parametrize("n_heads, n_kv, tokens", [(8, 8, 1), (8, 2, 33), (12, 4, 7)])
def test_reference_attend_is_the_definition(n_heads, n_kv, tokens):
    """The grouped einsum of reference.attend against the definition written head by head."""
    rng = np.random.default_rng()
    q, k, v = rng.standard_normal((n_heads, D)), rng.standard_normal((tokens, n_kv, D)), rng.standard_normal((tokens, n_kv, D))
    want = np.empty_like(q)
    for h in range(n_heads):
        s = 0.3 * (k[:, h // (n_heads // n_kv)] @ q[h])
        p = np.exp(s - s.max())
        want[h] = (p / p.sum()) @ v[:, h // (n_heads // n_kv)]
    np.testing.assert_allclose(ref.attend(q, k, v, 0.3), want, rtol=1e-12, atol=1e-12)


def test_reference_padding_slot_is_skipped_and_slots_are_distinct():
    kp, vp = np.full((2, KV, D // 8, BS, 8), np.nan), np.full((2, KV, D, BS), np.nan)
    k = np.ones((2, KV, D))
    ref.reshape_and_cache(kp, vp, k, k, np.array([3, -1]))
    assert (kp[0, :, :, 3] == 1).all() and np.isnan(kp[0, :, :, 4]).all()
    with pytest.raises(ValueError, match="one slot"):
        ref.reshape_and_cache(kp, vp, k, k, np.array([5, 5]))


def test_reference_contiguous_overflow_keeps_the_last_tokens():
    kc = np.arange(2 * 1 * 4 * 1, dtype=np.float64).reshape(2, 1, 4, 1)
    k, _ = ref.contiguous_tokens(kc, kc, 0, 6)  # positions 2..5 in slots 2, 3, 0, 1
    assert k[:, 0, 0].tolist() == [2, 3, 0, 1]


@pytest.fixture
def jobs(monkeypatch):
    """The launches kernels.attention makes, recorded instead of run (zero outputs)."""
    made = []

    def record(job):
        made.append(job)
        return [mx.zeros(tuple(s), d) for s, d in job.outputs]

    monkeypatch.setattr(at, "launch", record)
    return made


@pytest.mark.parametrize("combine", ["last_group", "launch"])
@pytest.mark.parametrize("ctx, split_from, partition, split, partitions, qs", [
    (300, at.SPLIT_FROM, None, False, 1, 4),   # one partition: no split
    (2048, at.SPLIT_FROM, None, False, 1, 4),  # short context: one launch, one threadgroup per KV head
    (2049, at.SPLIT_FROM, None, True, 17, 1),  # past SPLIT_FROM: partitions of 128, merged
    (1000, 0, None, True, 8, 4),               # split forced (the checks' setting)
    (4096, 0, None, True, 32, 1),              # 64 threadgroups: no query split
    (2049, at.SPLIT_FROM, 512, True, 5, 4),    # partitions of a given length
    (4096, 0, 56, True, 74, 1),                # 74 partitions: merged, 3 a lane
    (4096, 0, 24, True, 171, 1),               # more than MERGE_PARTS partitions: the combine launch
])
def test_split_decision_sets_the_grid(jobs, combine, ctx, split_from, partition, split, partitions, qs):
    """The launches flash_decode makes (recorded, not run): the unsplit body gets one threadgroup
    per (KV head, sequence); a split one per partition too, merged in the same launch by the last
    threadgroup of each head group (counters of its own: one per threadgroup row of the grid), or
    by a combine launch (attn_combine). Grids of at most 64 threadgroups also split each KV head's
    4 query heads over threadgroups (QS)."""
    k = mx.zeros((1, KV, 4096, D), mx.float16)
    with options.use(attn_combine=combine):
        at.flash_decode(q16(), k, k, [ctx], 0.125, split_from=split_from, partition=partition)
    merged = split and combine == "last_group" and partitions <= at.MERGE_PARTS
    assert len(jobs) == (2 if split and not merged else 1)
    assert jobs[0].grid == (partitions * 32 * at.NSIMD, KV * qs, 1)
    assert (jobs[0].constants["G"], jobs[0].constants["QS"]) == (4 // qs, qs)
    assert jobs[0].spec.name.endswith("_merge") == merged
    if merged:
        assert jobs[0].inputs[-1].dtype == mx.uint32 and jobs[0].inputs[-1].size >= KV * qs
        assert jobs[0].outputs[-1][0] == (1, H, D)
    if len(jobs) == 2:
        assert jobs[1].grid[1] == H  # the combine: every query head


def test_merge_counters_are_checked_before_the_launch(jobs):
    k = mx.zeros((1, KV, 4096, D), mx.float16)
    with options.use(attn_combine="last_group"):
        for bad in (mx.zeros((KV,), mx.int32), mx.zeros((KV - 1,), mx.uint32), mx.zeros((KV, 1), mx.uint32)):
            with pytest.raises(ValueError, match="counters must be uint32"):
                at.flash_decode(q16(), k, k, [3000], 0.125, counters=bad)
        assert not jobs
        at.flash_decode(q16(), k, k, [3000], 0.125, counters=at.merge_counters(KV))  # one a threadgroup row
    assert len(jobs) == 1


@pytest.mark.parametrize("longest, grids, want", [
    (4240, 8, 128),     # Llama-3 decode at depth 4096: 34 partitions, 272 threadgroups
    (2049, 8, 128),
    (16384, 8, 256),    # 64 partitions of 256
    (32768, 8, 512),    # 64 partitions of 512
    (131072, 8, 1024),  # at most PARTITION_MOST
    (100, 8, 128),      # at least one chunk (a thread a token)
    (4096, 8 * 16, 1024),  # a 16-token prompt's grid is large already
    (4096, 1, 128),
])
def test_auto_partition_aims_at_the_split_grid(longest, grids, want):
    assert at.auto_partition(longest, grids) == want


@pytest.mark.parametrize("parts, want", [
    (64, 16), (33, 16), (17, 16), (16, 16), (15, 8), (10, 8), (6, 4), (5, 4), (3, 2), (2, 2), (1, 1),
])
def test_merge_loads_never_exceed_the_partitions(parts, want):
    """The merge's loads at a time: a power of two up to 16, at most `parts` (its last round is
    shifted back to end at the last partition, so it must not start before the first)."""
    assert at.merge_loads(parts) == want


def test_merge_loads_reject_what_the_merge_cannot_take():
    for parts in (0, at.MERGE_PARTS + 1):
        for of in (at.merge_loads, at.merge_lane):
            with pytest.raises(ValueError, match="partitions"):
                of(parts)


@pytest.mark.parametrize("parts, lane", [(1, 2), (33, 2), (64, 2), (65, 3), (96, 3), (97, 4), (128, 4)])
def test_merge_lane_holds_every_partition(parts, lane):
    """A lane of the merge weighs 2 partitions up to 64 (the launches merged before it took
    more keep their form), then as few as hold them all; its weights' threadgroup memory grows
    with it."""
    assert at.merge_lane(parts) == lane
    more = (at.decode_threadgroup_bytes(4, 128, at.NSIMD, False, parts)
            - at.decode_threadgroup_bytes(4, 128, at.NSIMD, False, 0))
    assert more == 4 * (1 + 4 * 32 * lane)


@pytest.mark.parametrize("group, head_dim, parts, splits, loads", [
    (4, 128, 65, 1, 16),   # the 8B's heads: 128 slots, every thread
    (4, 128, 34, 1, 16),
    (2, 128, 34, 2, 16),   # Qwen3's: 64 slots, the other 64 threads take the second run
    (2, 128, 33, 2, 16),   # runs of 16 and 17
    (2, 128, 31, 1, 16),   # fewer than two runs of 16
    (1, 64, 40, 2, 16),    # 16 slots: two runs (the threads past 32 idle)
    (4, 256, 40, 1, 16),   # 256 slots: two a thread
    (2, 128, 8, 1, 8),
])
def test_merge_splits_a_slots_partitions_where_threads_are_idle(group, head_dim, parts, splits, loads):
    """The merge's runs a slot (MSPLIT) and its loads a round (MLOADS, for the shorter run): two
    runs where the slots take at most half the threads and there are 32 partitions or more."""
    c = at.merge_constants(group, head_dim, at.NSIMD, parts)
    assert (c["MSPLIT"], c["MLOADS"], c["MLANE"]) == (splits, loads, at.merge_lane(parts))
    assert c["MLOADS"] <= parts // splits
    with options.use(attn_merge_split=False):
        assert at.merge_splits(group, head_dim, at.NSIMD, parts) == 1


@pytest.mark.parametrize("ctx, split_from, loads", [(8192, at.SPLIT_FROM, 16), (2600, at.SPLIT_FROM, 16), (1000, 0, 8)])
def test_merge_loads_of_the_launch(jobs, ctx, split_from, loads):
    """The merged launch loads its partitions' partials 16 at a time, fewer where it has fewer
    than 16 partitions (partitions of 128 tokens: 64, 21 and 8 of them)."""
    k = mx.zeros((1, 8, 8192, 128), mx.float16)
    q = mx.zeros((1, 32, 128), mx.float16)
    with options.use(attn_combine="last_group"):
        at.flash_decode(q, k, k, [ctx], 0.125, split_from=split_from)
    assert len(jobs) == 1 and jobs[0].constants["MLOADS"] == loads


def test_k_slots_fit_the_backend(jobs, monkeypatch):
    """K's slots of threadgroup memory: 2 within CUDA's 48 KiB, 1 within Metal's 32 KiB; the
    option fixes them, and a value past 2 is refused before any launch."""
    k = mx.zeros((1, 8, 4096, 128), mx.float16)
    q = mx.zeros((1, 32, 128), mx.float16)
    at.flash_decode(q, k, k, [300], 0.125)
    assert jobs[-1].constants["KSLOTS"] == 2
    assert at.decode_threadgroup_bytes(4, 128, at.NSIMD, False, at.MERGE_PARTS, 2) <= 48 * 1024
    monkeypatch.setattr(at.backends, "threadgroup_memory", lambda: 32 * 1024)
    assert at.k_slots(4, 128, False, 64) == 1
    for chosen in (0, 1, 2):
        with options.use(attn_k_slots=chosen):
            at.flash_decode(q, k, k, [300], 0.125)
        assert jobs[-1].constants["KSLOTS"] == chosen
    made = len(jobs)
    with options.use(attn_k_slots=3), pytest.raises(ValueError, match="attn_k_slots"):
        at.flash_decode(q, k, k, [300], 0.125)
    assert len(jobs) == made  # nothing launched


@pytest.mark.parametrize("heads, head_dim, mma, want", [
    ((32, 8), 128, "auto", 1),   # Llama-3-8B: 4 heads a threadgroup
    ((32, 8), 64, "auto", 1),    # Llama-3.2-1B
    ((16, 8), 128, "auto", 0),   # Qwen3: 2 heads, FMAs
    ((16, 8), 128, "on", 1),
    ((28, 4), 128, "on", 1),     # 7 heads: rows 7 of 8
    ((32, 8), 128, "off", 0),
    ((16, 8), 256, "on", 0),     # D past 32 NSIMD: V's words would not fit the registers
    ((64, 4), 128, "on", 0),     # 16 heads: past a fragment's 8 rows
])
def test_mma_where_the_form_allows(jobs, heads, head_dim, mma, want):
    """Scores and P.V on SIMD-group matrices: auto from 4 heads a threadgroup, on wherever the
    form allows (<= 8 heads, D a multiple of 32 up to 128, K slots), off never; a launch records
    it as its MMA constant, and its threadgroup memory holds Q's fp16 rows."""
    n_heads, n_kv = heads
    k = mx.zeros((1, n_kv, 4096, head_dim), mx.float16)
    q = mx.zeros((1, n_heads, head_dim), mx.float16)
    with options.use(attn_mma=mma, attn_query_split=0):
        at.flash_decode(q, k, k, [3000], head_dim ** -0.5)
    c = [j.constants for j in jobs if "MMA" in j.constants][-1]  # (the combine launch follows)
    assert c["MMA"] == want
    assert at.decode_threadgroup_bytes(c["G"], head_dim, at.NSIMD, False, False, c["KSLOTS"], bool(want)) \
        - at.decode_threadgroup_bytes(c["G"], head_dim, at.NSIMD, False, False, c["KSLOTS"]) \
        == (16 * (head_dim + 8) - 2 if want else 0)
    with options.use(attn_mma=mma, attn_k_slots=0):
        at.flash_decode(q, k, k, [3000], head_dim ** -0.5)
    assert [j.constants for j in jobs if "MMA" in j.constants][-1]["MMA"] == 0  # K in registers


def test_mma_launches_aim_at_a_smaller_grid(jobs):
    """The MMA form's split launches aim at SPLIT_GRID_MMA threadgroups (Llama-3's heads at 8192:
    32 partitions of 256 tokens), with K copied by rows over the contiguous cache; the FMA form
    keeps SPLIT_GRID (Qwen3's heads: 64 of 128); a batch's large grid keeps K's copies by token."""
    k = mx.zeros((1, 8, 8192, 128), mx.float16)
    for heads, parts, krow in ((32, 32, 1), (16, 64, 0)):
        at.flash_decode(mx.zeros((1, heads, 128), mx.float16), k, k, [8192], 0.125)
        c = [j for j in jobs if "MMA" in j.constants][-1]
        assert (c.constants["MMA"], c.constants["KROW"], c.grid[0] // (32 * at.NSIMD)) == (krow, krow, parts)
    with options.use(attn_split_grid=512):  # the option, read at each launch
        at.flash_decode(mx.zeros((1, 32, 128), mx.float16), k, k, [8192], 0.125)
    assert [j for j in jobs if "MMA" in j.constants][-1].grid[0] // (32 * at.NSIMD) == 64
    kb = mx.zeros((8, 8, 8192, 128), mx.float16)
    at.flash_decode(mx.zeros((8, 32, 128), mx.float16), kb, kb, [8192] * 8, 0.125)
    assert [j for j in jobs if "MMA" in j.constants][-1].constants["KROW"] == 0


@pytest.mark.parametrize("group, threadgroups, most, want", [
    (4, 8, 64, 4),     # Llama-3-8B decode: 8 KV heads of 4 query heads -> 32 threadgroups
    (4, 64, 64, 1),    # already 64 threadgroups (partitions, or a batch): one per KV head
    (4, 16, 64, 4),
    (4, 24, 64, 2),    # 48 fits, 96 would not
    (8, 8, 64, 8),
    (6, 8, 64, 6),     # any divisor of the group, not only powers of two
    (6, 16, 64, 3),
    (7, 4, 64, 7),     # Qwen2.5-7B: 4 KV heads of 7 query heads -> 28 threadgroups of one
    (7, 16, 64, 1),    # 112 would pass the limit: 7 has no smaller divisor
    (1, 8, 64, 1),     # no grouping: nothing to split
    (4, 8, 0, 1),      # switched off (LATHE_ATTN_QUERY_SPLIT=0)
])
def test_query_split_keeps_small_grids_within_the_limit(group, threadgroups, most, want):
    assert at.query_split(group, threadgroups, most) == want


def test_device_lengths_size_the_grid_for_the_cache(jobs):
    """Lengths on the device (a compiled decode step) cannot be read before the launch: the
    grid covers the whole cache, split past SPLIT_FROM like a host length of max_seq."""
    k = mx.zeros((1, KV, 4096, D), mx.float16)
    lens = mx.array([5], dtype=mx.int32)
    at.flash_decode(q16(), k, k, lens, 0.125)
    assert len(jobs) == 1 and jobs[0].grid == (32 * 32 * at.NSIMD, KV, 1)  # 32 partitions of 128, merged
    assert jobs[0].inputs[3] is lens  # read by the kernel as it is, no host copy
    with pytest.raises(ValueError, match="int32"):
        at.flash_decode(q16(), k, k, mx.array([5.0]), 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 300, 2049, 4096])
def test_device_lengths_against_float64(ctx):
    """flash_decode with its length on the device (grid sized for the 4096-row cache, split in
    32 partitions, most of them empty for short contexts) against the float64 reference, with the
    slots past the context NaN, and equal to the host-length launch."""
    rng = np.random.default_rng()
    rows, group = 4096, 4
    kc = rng.standard_normal((1, KV, rows, D)).astype(np.float16)
    vc = rng.standard_normal((1, KV, rows, D)).astype(np.float16)
    kc[:, :, ctx:], vc[:, :, ctx:] = np.nan, np.nan
    q = rng.standard_normal((1, KV * group, D)).astype(np.float16)
    want = ref.attend(q[0], kc[0, :, :ctx].transpose(1, 0, 2), vc[0, :, :ctx].transpose(1, 0, 2), 0.125)
    args = (mx.array(q), mx.array(kc), mx.array(vc))
    dev = np.array(at.flash_decode(*args, mx.array([ctx], dtype=mx.int32), 0.125)[0], dtype=np.float64)
    host = np.array(at.flash_decode(*args, [ctx], 0.125)[0], dtype=np.float64)
    assert not np.isnan(dev).any()
    assert np.linalg.norm(dev - want) / np.linalg.norm(want) <= 2e-3
    assert np.allclose(dev, host, atol=2e-3)


def test_calls_without_counters_share_their_streams(jobs):
    """attn_combine's auto merges a split call in its own launch; calls that bring no counters
    take their stream's, which each launch leaves zero: no fresh array (a memset) a call."""
    k = mx.zeros((1, KV, 4096, D), mx.float16)
    for _ in range(2):
        at.flash_decode(q16(), k, k, [4000], 0.125)
    assert len(jobs) == 2 and "MLOADS" in jobs[0].constants
    assert jobs[0].inputs[-1] is jobs[1].inputs[-1]


def test_paged_device_form_sizes_the_grid_for_the_table(jobs):
    """Device context lengths with a device block table (a compiled step): nothing read on the
    host, the grid sized for all the table's blocks (split past SPLIT_FROM)."""
    k, v = pools(nb=200)
    table, lens = mx.arange(160, dtype=mx.int32)[None], mx.array([5], dtype=mx.int32)
    at.paged_attention(q16(), k, v, table, lens, 0.125)
    assert len(jobs) == 1 and jobs[0].grid == (20 * 32 * at.NSIMD, KV, 1)  # 2560 tokens: 20 partitions
    assert jobs[0].inputs[3] is lens and jobs[0].inputs[4] is table


def test_paged_rope_attention_writes_through_the_table_in_one_launch(jobs):
    """paged_rope_attention (launches recorded): one launch over the batch, its QKV rows, the
    positions and the table as given on the device, the pools written in place; host ids checked
    and moved to the device; the grid sized for the longest position (host) or the table (device)."""
    k, v = pools(nb=40)
    table, positions = mx.arange(40, dtype=mx.int32).reshape(2, 20), mx.array([5, 300], dtype=mx.int32)
    qkv = qkv16(b=2)
    out, k2, v2 = at.paged_rope_attention(qkv, k, v, table, positions, 0.125, n_heads=H, split_from=0)
    assert len(jobs) == 2 and jobs[0].spec.name.startswith("lathe_paged_rope_attention_split")  # and the combine
    given = dict(zip(jobs[0].spec.inputs, jobs[0].inputs))
    assert given["qkv"] is qkv and given["pos"] is positions and given["table"] is table
    assert jobs[0].spec.written_in_place == (1, 2) and jobs[0].grid[2] == 2
    assert out.shape == (2, H, D) and k2.shape == k.shape and v2.shape == v.shape
    jobs.clear()
    at.paged_rope_attention(qkv16(b=2), k, v, np.arange(40).reshape(2, 20), [5, 17], 0.125, n_heads=H)
    assert len(jobs) == 1 and jobs[0].spec.name.startswith("lathe_paged_rope_attention_whole")  # 18 tokens: one partition


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 17, 700, 2100])
def test_paged_device_form_against_float64(ctx):
    """reshape_and_cache with device slots (one of them outside the pool: dropped, not written)
    and paged_attention with device lengths and table, grid sized for all 160 blocks, against
    the float64 reference; the untouched pool stays NaN."""
    rng = np.random.default_rng()
    nb, group = 170, 4
    table = rng.permutation(nb)[:160].astype(np.int32)
    kp = np.full((nb, KV, D // 8, BS, 8), np.nan, np.float16)
    vp = np.full((nb, KV, D, BS), np.nan, np.float16)
    k = rng.standard_normal((ctx, KV, D)).astype(np.float16)
    v = rng.standard_normal((ctx, KV, D)).astype(np.float16)
    slots = table[np.arange(ctx) // BS] * BS + np.arange(ctx) % BS
    ref_k, ref_v = kp.astype(np.float64), vp.astype(np.float64)
    ref.reshape_and_cache(ref_k, ref_v, k, v, slots)
    stray = np.concatenate([slots, [nb * BS + 3]]).astype(np.int32)  # past the pool: dropped
    k1 = np.concatenate([k, rng.standard_normal((1, KV, D)).astype(np.float16)])
    v1 = np.concatenate([v, rng.standard_normal((1, KV, D)).astype(np.float16)])
    kc, vc, written = at.reshape_and_cache(mx.array(k1), mx.array(v1), mx.array(kp), mx.array(vp),
                                           mx.array(stray))
    q = rng.standard_normal((1, KV * group, D)).astype(np.float16)
    out = at.paged_attention(mx.array(q), kc, vc, mx.array(table[None]), mx.array([ctx], dtype=mx.int32),
                             0.125, after=written)
    got = np.array(out[0], dtype=np.float64)
    kk, vv = ref.paged_tokens(ref_k, ref_v, table, ctx)
    want = ref.attend(q[0], kk, vv, 0.125)
    assert not np.isnan(got).any()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 2e-3
    pool_k, pool_v = np.array(kc, dtype=np.float64), np.array(vc, dtype=np.float64)
    assert np.array_equal(pool_k, ref_k, equal_nan=True) and np.array_equal(pool_v, ref_v, equal_nan=True)


def test_chained_bench_orders_each_call_after_the_one_before():
    """The chained decode benchmark (a decode layer's latency, not a round's throughput): every
    call after the first takes its q through mx.depends on the call before's output, across
    sets, and computes what the unchained call does."""
    from harness.suites.attention import _bench

    chained = _bench("mlx.sdpa", "qwen3-0.6b", 1, 512, chained=True)
    plain = _bench("mlx.sdpa", "qwen3-0.6b", 1, 512)
    assert chained.benchmark == "attention-decode-chain-b1" and plain.benchmark == "attention-decode-b1"
    sets = [chained.make_set() for _ in range(2)]
    originals = [s["q"] for s in sets]
    outs = [chained.step(sets[0])[0]]
    assert sets[0]["q"] is originals[0]  # the first call takes its q as it is
    outs += [chained.step(sets[k % 2])[0] for k in (1, 2)]
    mx.eval(outs)
    assert sets[1]["q"] is not originals[1] and sets[0]["q"] is not originals[0]  # each waits for the one before
    want = plain.step({**sets[1], "q": originals[1]})[0]
    assert np.allclose(np.array(outs[1]), np.array(want))


def test_mixed_batch_bench_reads_each_sequence_to_its_own_length():
    """The mixed decode benchmark (batches of 8 and 32): lengths from ctx down to
    about ctx/2, the bytes those rows hold, MLX's sdpa masked to each sequence's own rows (as
    sdpa over that sequence alone), and a paged table that gives every sequence blocks of its
    own, scattered over a pool just large enough."""
    from harness.suites.attention import _bench, mixed_lengths

    lens = mixed_lengths(8, 1000)
    assert lens[0] == 1000 and lens[-1] == 500 and lens == sorted(lens, reverse=True) and len(set(lens)) == 8
    assert mixed_lengths(1, 64) == [64]
    sdpa = _bench("mlx.sdpa", "qwen3-0.6b", 3, 40, mixed=True)
    n_heads, n_kv, d = 16, 8, 128
    assert sdpa.benchmark == "attention-decode-b3-mixed"
    assert sdpa.bytes == 2 * n_kv * sum(mixed_lengths(3, 40)) * d * 2 + 2 * 2 * 3 * n_heads * d
    s = sdpa.make_set()
    (got,) = sdpa.step(s)
    for b, n in enumerate(mixed_lengths(3, 40)):
        alone = mx.fast.scaled_dot_product_attention(s["q"][b:b + 1, :, None, :], s["k"][b:b + 1, :, :n],
                                                     s["v"][b:b + 1, :, :n], scale=d ** -0.5)
        assert np.allclose(np.array(got[b:b + 1], dtype=np.float32), np.array(alone, dtype=np.float32), atol=2e-3)
    paged = _bench("paged_v2", "qwen3-0.6b", 3, 40, mixed=True).make_set()
    table, need = np.array(paged["table"]), [-(-n // 16) for n in mixed_lengths(3, 40)]
    used = np.concatenate([table[b, :n] for b, n in enumerate(need)])
    assert paged["k"].shape[0] == sum(need) and sorted(used.tolist()) == list(range(sum(need)))


def test_contiguous_cache_reads_the_pool_through_the_table():
    """The bench's verify reads a paged pool as contiguous caches: token t of sequence b, kv head
    h is K pool[table[b, t // BS], h, :, t % BS, :] and V pool[table[b, t // BS], h, :, t % BS]."""
    from harness.suites.attention import _bench, contiguous_cache

    s = _bench("paged_v1", "llama3.2-1b", 3, 50, mixed=True).make_set()
    k, v = contiguous_cache(s["k"], s["v"], s["table"])
    kp, vp, table = np.array(s["k"]), np.array(s["v"]), np.array(s["table"])
    assert k.shape == v.shape == (3, 8, table.shape[1] * 16, 64)
    k, v = np.array(k), np.array(v)
    for b, t, h in ((0, 0, 0), (0, 49, 7), (1, 17, 3), (2, 24, 5)):
        block, off = table[b, t // 16], t % 16
        assert np.array_equal(k[b, h, t], kp[block, h, :, off, :].reshape(-1))
        assert np.array_equal(v[b, h, t], vp[block, h, :, off])


def test_decode_bench_rows_verify_our_kernels_not_the_peer():
    from harness.suites.attention import _bench

    assert _bench("mlx.sdpa", "qwen3-0.6b", 1, 512).verify is None
    assert _bench("flash_decode", "qwen3-0.6b", 1, 512, chained=True).verify is None
    assert all(_bench(k, "gemma2-2b", 8, 512, mixed=True).verify for k in ("flash_decode", "paged_v1", "paged_v2"))


# ---- the wgmma prompt kernel (a native CUDA kernel, kernels/native.py) ---------------------------


def _nvrtc_missing() -> str:
    from kernels import ptx

    try:
        ptx.nvrtc()
    except (FileNotFoundError, OSError) as exc:
        return str(exc)
    return ""


@pytest.mark.skipif(bool(_nvrtc_missing()), reason=_nvrtc_missing() or "available")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("paged, block_size", [(0, 0), (1, 16), (1, 32)])
def test_wgmma_prefill_compiles_for_sm90a(head_dim, paged, block_size):
    """Every instantiation the host can ask for builds (NVRTC, no GPU), with its own symbol."""
    from kernels import native

    consts = (("HEAD_DIM", head_dim), ("PAGED", paged), ("BLOCK_SIZE", block_size))
    cubin = native.cubin(at.WGMMA_PREFILL, "lathe_prefill_wgmma", consts)
    assert cubin[:4] == b"\x7fELF"
    assert native.entry_name("lathe_prefill_wgmma", dict(consts)).encode() in cubin


def test_wgmma_prefill_refuses_what_it_cannot_take():
    assert "head_dim 256" in at.wgmma_prefill_unavailable(256, 0)
    assert "block size 12" in at.wgmma_prefill_unavailable(128, 12)
    if not at.native.available():  # this machine: the reason, before any launch
        assert at.wgmma_prefill_unavailable(128, 0) == at.native.unavailable_reason() != ""
        with pytest.raises(ValueError, match="prefill kernel 'wgmma'"):
            at.prefill_attention(mx.zeros((3, H, D), mx.float16), mx.zeros((KV, 32, D), mx.float16),
                                 mx.zeros((KV, 32, D), mx.float16), 0, 0.1, kernel="wgmma")


def test_wgmma_prefill_shared_memory_fits_an_sm():
    """Q's tile and three stages of K and V: within the 227 KiB a Hopper CTA may take."""
    assert at.wgmma_prefill_bytes(128) <= 227 * 1024
    assert at.wgmma_prefill_bytes(64) == (at.WGMMA_ROWS + 6 * at.WGMMA_KEYS) * 64 * 2 + 48 + 1024


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [0, 16, 32])
@pytest.mark.parametrize("tokens, pos", [(200, 0), (77, 333)])
def test_wgmma_prefill_matches_the_tiled_kernel(bs, tokens, pos):
    """Where it runs (Hopper), the wgmma kernel agrees with the portable tiled one on the same
    cache, contiguous (bs 0) and paged with each block size of the pool (V's rows of 32 and 64
    bytes, each its own swizzle; both kernels are checked against float64 by `lathe check attention`)."""
    from kernels import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    rng = np.random.default_rng(7)
    n_heads, n_kv, head_dim, paged = 32, 8, 128, bs > 0
    n = pos + tokens
    k = rng.standard_normal((n_kv, n, head_dim)).astype(np.float16)
    v = rng.standard_normal((n_kv, n, head_dim)).astype(np.float16)
    q = mx.array(rng.standard_normal((tokens, n_heads, head_dim)).astype(np.float16))
    caches, table = (mx.array(k), mx.array(v)), None
    if paged:
        blocks = -(-n // bs) + 2
        k_pool = np.zeros((blocks, n_kv, head_dim // ref.X, bs, ref.X), np.float16)
        v_pool = np.zeros((blocks, n_kv, head_dim, bs), np.float16)
        table = rng.permutation(blocks)[: -(-n // bs)].astype(np.int32)
        slots = table[np.arange(n) // bs] * bs + np.arange(n) % bs
        ref.reshape_and_cache(k_pool, v_pool, k.transpose(1, 0, 2), v.transpose(1, 0, 2), slots)
        caches = (mx.array(k_pool), mx.array(v_pool))
    outs = [np.array(at.prefill_attention(q, *caches, pos, head_dim ** -0.5, block_table=table, kernel=kernel))
            for kernel in ("wgmma", "tiled")]
    np.testing.assert_allclose(outs[0].astype(np.float32), outs[1].astype(np.float32), atol=3e-3, rtol=0)


@pytest.mark.skipif(bool(_nvrtc_missing()), reason=_nvrtc_missing() or "available")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("neox, head_norm", [(0, 0), (1, 0), (1, 1), (0, 1)])
def test_rope_prefill_compiles_for_sm90a(head_dim, neox, head_norm):
    """The wgmma kernel's ROPE form builds for every form rope_prefill_attention asks for."""
    from kernels import native

    consts = (("HEAD_DIM", head_dim), ("PAGED", 0), ("BLOCK_SIZE", 0), ("ROPE", 1), ("NEOX", neox),
              ("HEAD_NORM", head_norm))
    cubin = native.cubin(at.WGMMA_PREFILL, "lathe_prefill_wgmma", consts)
    assert native.entry_name("lathe_prefill_wgmma", dict(consts)).encode() in cubin


def test_rope_prefill_refuses_before_any_launch():
    """What one launch cannot take is named (the caller then runs two), and bad input is a
    ValueError before anything runs."""
    assert "129 tokens" in at.rope_prefill_unavailable(129, 128)
    assert at.rope_prefill_unavailable(16, 128, window=64) == "a sliding window"
    assert at.rope_prefill_unavailable(16, 128, softcap=30.0) == "a softcap of the scores"
    assert "head_dim 256" in at.rope_prefill_unavailable(16, 256)
    cache = mx.zeros((KV, 32, D), mx.float16)
    qkv = mx.zeros((3, (H + 2 * KV) * D), mx.float16)
    with pytest.raises(ValueError, match="qkv must be"):
        at.rope_prefill_attention(qkv[:, 1:], cache, cache, 0, 0.1, n_heads=H)
    with pytest.raises(ValueError, match="do not fit the cache"):
        at.rope_prefill_attention(qkv, cache, cache, 30, 0.1, n_heads=H)
    with pytest.raises(ValueError, match="head norms take"):
        at.rope_prefill_attention(qkv, cache, cache, 0, 0.1, n_heads=H, q_norm=mx.ones((D,)))
    if not at.native.available():
        with pytest.raises(ValueError, match="rope_prefill_attention: native CUDA"):
            at.rope_prefill_attention(qkv, cache, cache, 0, 0.1, n_heads=H)


@pytest.mark.gpu
@pytest.mark.parametrize("head_norm", [False, True])
@pytest.mark.parametrize("tokens, pos", [(16, 0), (100, 37)])
def test_rope_prefill_matches_its_two_launches(head_norm, tokens, pos):
    """The one launch agrees with the two it replaces (head_norm_rope_neox_qkv_write or
    rope_qkv_write, then the wgmma prefill) on the same inputs: the same cache rows (K to the
    rounding of its norm's sum), outputs within fp16 rounding."""
    from kernels import native
    from kernels import rope

    if not native.available():
        pytest.skip(native.unavailable_reason())
    rng = np.random.default_rng(11)
    n_heads, n_kv, head_dim, max_seq = 16, 8, 128, pos + tokens + 20
    qkv = mx.array(rng.standard_normal((tokens, (n_heads + 2 * n_kv) * head_dim)).astype(np.float16))
    old = rng.standard_normal((2, n_kv, max_seq, head_dim)).astype(np.float16)
    norms = dict(q_norm=mx.array(rng.uniform(0.5, 1.5, head_dim).astype(np.float32)),
                 k_norm=mx.array(rng.uniform(0.5, 1.5, head_dim).astype(np.float32)), eps=1e-6) if head_norm else {}
    scale = head_dim ** -0.5
    out, k1, v1 = at.rope_prefill_attention(qkv, mx.array(old[0]), mx.array(old[1]), pos, scale, n_heads=n_heads,
                                            theta=1e6, neox=True, **norms)
    if head_norm:
        rot = rope.head_norm_rope_neox_qkv_write(qkv, norms["q_norm"], norms["k_norm"], mx.array(old[0]),
                                                 mx.array(old[1]), pos, n_heads=n_heads, eps=1e-6, theta=1e6)
    else:
        rot = rope.rope_qkv_write(qkv, mx.array(old[0]), mx.array(old[1]), pos, n_heads=n_heads, theta=1e6, neox=True)
    want = at.prefill_attention(rot.q, rot.k_cache, rot.v_cache, pos, scale, kernel="wgmma", after=rot.written)
    np.testing.assert_array_equal(np.array(v1), np.array(rot.v_cache))
    np.testing.assert_allclose(np.array(k1).astype(np.float32), np.array(rot.k_cache).astype(np.float32),
                               atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.array(out).astype(np.float32), np.array(want).astype(np.float32), atol=3e-3, rtol=0)


@pytest.mark.skipif(bool(_nvrtc_missing()), reason=_nvrtc_missing() or "available")
def test_native_image_is_a_compressed_fatbin_where_nvfatbin_is_found():
    """What a native launch hands MLX (which hashes it at every launch): the cubin, or a fatbin of
    it (magic 0xBA55ED50) a good deal smaller; 'fatbin' without nvFatbin is an error, not a cubin."""
    from kernels import native

    cubin = native.cubin(at.WGMMA_PREFILL, "lathe_prefill_wgmma", (("HEAD_DIM", 128), ("PAGED", 0), ("BLOCK_SIZE", 0)))
    assert native.image(cubin, "cubin") == cubin
    if native.nvfatbin() is None:
        assert native.image(cubin, "auto") == cubin
        with pytest.raises(RuntimeError, match="libnvfatbin not found"):
            native.image(cubin, "fatbin")
        return
    packed = native.image(cubin, "fatbin")
    assert packed[:4] == bytes.fromhex("50ed55ba") and len(packed) < len(cubin) // 2
    assert native.image(cubin, "auto") == packed
    with pytest.raises(ValueError, match="form must be"):
        native.image(cubin, "elf")
