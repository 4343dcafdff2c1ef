"""The layer blocks (kernels.blocks): the stacked weights token_block reads and its argument checks,
all before any launch (CPU). The blocks' GPU checks are `lathe check blocks` (harness/suites/blocks.py),
run by tests/test_check_suites.py on a GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import blocks, gemv
from reference import kquant
from reference.quant import quantize

D, F, HQ, HKV, HD = 64, 96, 4, 2, 64


def _packed(n: int, k: int, seed: int, qtype: str = "q8_0") -> gemv.Packed:
    w = (kquant.quantize if qtype in gemv.K_QTYPES else quantize)(
        np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), qtype)
    return gemv.repack(mx.array(w), qtype, n, k)


def test_a_stack_holds_every_layer_at_its_stride():
    """Layer l's bytes at l * stride (a multiple of 256, so every layer's 16-byte loads stay
    aligned), equal to the matrix it was made from; layer(l) is a view of them."""
    mats = [_packed(24, 64, seed) for seed in range(3)]  # 24 * 2 * 34 = 1632 bytes: padded
    stack = blocks.Stack(mats)
    assert stack.stride % blocks.STRIDE_ALIGN == 0 and stack.stride >= mats[0].data.size
    assert stack.data.shape == (3, stack.stride)  # a row a layer: MLX's dimensions are 32-bit
    data = np.array(stack.data).reshape(-1)
    for i, m in enumerate(mats):
        assert np.array_equal(data[i * stack.stride: i * stack.stride + m.data.size], np.array(m.data))
        assert np.array_equal(np.array(stack.layer(i).data), np.array(m.data))
        assert (stack.layer(i).n, stack.layer(i).k, stack.layer(i).qtype) == (24, 64, "q8_0")


def test_a_stack_takes_one_shape_and_two_types():
    with pytest.raises(ValueError, match="share one shape"):
        blocks.Stack([_packed(24, 64, 0), _packed(32, 64, 1)])
    assert blocks.Stack([_packed(24, 64, 0), _packed(24, 64, 1, "q4_0")]).qtypes == ("q8_0", "q4_0")
    with pytest.raises(ValueError, match="at most two"):
        blocks.Stack([_packed(8, 256, 0, "q4_0"), _packed(8, 256, 1, "q4_k"), _packed(8, 256, 2, "q6_k")])
    with pytest.raises(ValueError, match="repacked"):
        blocks.Stack([mx.zeros((10,), mx.uint8)])


def test_a_stack_of_two_types_pads_each_layer_to_the_largest():
    """llama.cpp's Q4_K_M: a projection Q6_K in some layers, Q4_K in the others. Each layer at
    the same stride (the Q6_K matrix's, padded), its view of its own type and bytes."""
    mats = [_packed(8, 512, 0, "q4_k"), _packed(8, 512, 1, "q6_k"), _packed(8, 512, 2, "q4_k")]
    stack = blocks.Stack(mats)
    assert stack.qtypes == ("q4_k", "q6_k", "q4_k")
    assert stack.stride == -(-mats[1].data.size // blocks.STRIDE_ALIGN) * blocks.STRIDE_ALIGN
    data = np.array(stack.data).reshape(-1)
    for i, m in enumerate(mats):
        assert np.array_equal(data[i * stack.stride: i * stack.stride + m.data.size], np.array(m.data))
        assert stack.layer(i).qtype == m.qtype and np.array_equal(np.array(stack.layer(i).data), np.array(m.data))


def _stacks(layers: int = 2) -> blocks.LayerStacks:
    n_qkv = (HQ + 2 * HKV) * HD
    norm = mx.ones((layers, D), mx.float16)
    return blocks.LayerStacks(norm, blocks.Stack([_packed(n_qkv, D, i) for i in range(layers)]),
                              blocks.Stack([_packed(D, HQ * HD, i) for i in range(layers)]), norm,
                              blocks.Stack([_packed(2 * F, D, i) for i in range(layers)]),
                              blocks.Stack([_packed(D, F, i) for i in range(layers)]))


def _token(stacks=None, caches=2, queue=None, x=None, norm=None, pos=3, **gemma):
    stacks = stacks or _stacks()
    if norm is not None:
        stacks.ffn_norm = norm
    kv = [mx.zeros((HKV, 16, HD), mx.float16) for _ in range(caches)]
    return blocks.token_block(mx.zeros((1, D), mx.float16) if x is None else x, stacks, 1e-6, "q8_0", kv, list(kv),
                              pos, n_heads=HQ, queue=queue, **gemma)


GEMMA = blocks.LayerKind(post_norms=True, windows=True, activation="gelu")


def _gemma_stacks(post=True) -> blocks.LayerStacks:
    stacks = _stacks()
    if post:
        stacks.post_attn_norm = stacks.post_ffn_norm = mx.ones((2, D), mx.float16)
    return stacks


@pytest.mark.parametrize("call, message", [
    (lambda: _token(caches=1), "a K and a V cache for each of the 2 layers"),
    (lambda: _token(x=mx.zeros((blocks.BATCH_ROWS + 1, D), mx.float16)), "1..8 rows"),
    (lambda: _token(x=mx.zeros((2, D), mx.float16), pos=15), r"pos \+ 2 <= 16"),
    (lambda: _token(_gemma_stacks(), x=mx.zeros((2, D), mx.float32), layer_kind=GEMMA, windows=[4, 0]),
     "prompt form"),
    (lambda: _token(norm=mx.ones((D,), mx.float16)), r"norms must be \[2, width\]"),
    (lambda: _token(queue=blocks.block_queue()), r"queue must be uint32 \[>= 1792\]"),
    (lambda: _token(_gemma_stacks(False), x=mx.zeros((1, D), mx.float32), layer_kind=GEMMA, windows=[4, 0]),
     "post_attn_norm and post_ffn_norm"),
    (lambda: _token(_gemma_stacks(), layer_kind=GEMMA, windows=[4, 0]), "x must be float32"),
    (lambda: _token(_gemma_stacks(), x=mx.zeros((1, D), mx.float32), layer_kind=GEMMA, windows=[4]),
     "a window >= 0 for each of the 2 layers"),
    (lambda: _token(_gemma_stacks(), x=mx.zeros((1, D), mx.float32), layer_kind=GEMMA, windows=[4, 0],
                    inv_freqs=mx.zeros((3, HD // 2), mx.float32)), r"inv_freqs must be float32 \[32\] or \[2, 32\]"),
])
def test_token_block_rejects_bad_arguments_before_launch(call, message):
    from kernels.runtime import recording

    with recording() as rec, pytest.raises(ValueError, match=message):
        call()
    assert not rec.jobs


@pytest.mark.parametrize("items", [0, 9])
def test_token_block_refuses_x_items_outside_1_to_8_before_launch(items):
    """block_x_items 0 would never end the staging's loop: refused by name, nothing launched."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_x_items=items), recording() as rec, \
            pytest.raises(ValueError, match="block_x_items must be 1..8"):
        _token()
    assert not rec.jobs


# (d_model, n_qkv, heads x head_dim, F) of the models the loop runs: Qwen3-0.6B, Llama-3.2-1B, 8B
LAYERS = [(1024, 4096, 2048, 3072), (2048, 3072, 2048, 8192), (4096, 6144, 4096, 14336)]


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("shape", LAYERS)
@pytest.mark.parametrize("mode", ["shared", "per_gemv"])
def test_block_geometry_covers_every_row(shape, qtype, m, mode):
    """Each GEMV's tickets cover its rows, or stream them where capped (a capped grid needs all of
    K staged at once, and the last phase is never capped); UP's rows pair gate with up; the staged
    X' fits in threadgroup memory; per_gemv gives a GEMV its own rows and depth at the launch's
    NSIMD, shared the first GEMV's to all."""
    from kernels import options

    d, n_qkv, hd, f = shape
    gemvs = {blocks.UP: (2 * f, d), blocks.DOWN: (d, f), blocks.QKV: (n_qkv, d), blocks.O: (d, hd)}
    with options.use(block_geometry=mode):
        geo = blocks.block_geometry(qtype, m, gemvs, blocks.DOWN)
    assert gemv.v3_smem_bytes(m, geo.xchunk, geo.simds) <= gemv.SMEM_BUDGET
    assert geo.gemvs[blocks.UP][0] % 2 == 0
    for kind, (n, k) in gemvs.items():
        r, p, tickets = geo.gemvs[kind]
        assert tickets >= 1 and p >= 1
        if tickets * r * geo.simds < n:
            assert kind != blocks.DOWN and geo.xchunk >= k, (kind, r, tickets)
    if mode == "shared":
        assert len({g[:2] for g in geo.gemvs.values()}) == 1
    else:
        own = {kind: gemv.v3_geometry(qtype, m, n, k) for kind, (n, k) in gemvs.items()}
        assert geo.simds == max(g[1] for g in own.values())
        for kind, (n, k) in gemvs.items():
            r, _, p, _ = gemv.v3_geometry(qtype, m, n, k, simds=geo.simds)
            assert geo.gemvs[kind][:2] == (r + (r % 2 if kind == blocks.UP else 0), p)


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k", "q4_0", "q8_0"])
def test_k_quant_launches_cap_their_loads_in_flight(qtype):
    """A K-quant launch's GEMV phases take at most K_BLOCK_P loads a row in flight (their own v3 P
    is 4: the launch's registers past 128); other types keep their own; gemv_tuning's BLOCK_P,
    when given, sets every launch's."""
    from kernels import options

    d, n_qkv, hd, f = LAYERS[2]
    gemvs = {blocks.UP: (2 * f, d), blocks.DOWN: (d, f), blocks.QKV: (n_qkv, d), blocks.O: (d, hd)}
    own = max(gemv.v3_geometry(qtype, 1, n, k)[2] for n, k in gemvs.values())
    ps = {g[1] for g in blocks.block_geometry(qtype, 1, gemvs, blocks.DOWN).gemvs.values()}
    if qtype in gemv.K_QTYPES:
        assert own > blocks.K_BLOCK_P and ps == {blocks.K_BLOCK_P}
    else:
        assert max(ps) == gemv.v3_geometry(qtype, 1, *gemvs[blocks.UP])[2]
    with options.use(gemv_tuning="BLOCK_P=1"):
        assert {g[1] for g in blocks.block_geometry(qtype, 1, gemvs, blocks.DOWN).gemvs.values()} == {1}


@pytest.mark.parametrize("fit", [132, 396, 528, 10_000])
@pytest.mark.parametrize("shape", LAYERS)
def test_a_resident_fit_caps_each_claimed_phase(shape, fit):
    """block_grid=resident: every claimed GEMV phase takes at most the threadgroups that fit at
    once, streaming the rest of its rows; the last phase (run unclaimed, a threadgroup a row
    group) keeps its grid; a fit above every phase's tickets changes nothing."""
    d, n_qkv, hd, f = shape
    gemvs = {blocks.UP: (2 * f, d), blocks.DOWN: (d, f), blocks.QKV: (n_qkv, d), blocks.O: (d, hd)}
    plain = blocks.block_geometry("q8_0", 1, gemvs, blocks.DOWN)
    capped = blocks.block_geometry("q8_0", 1, gemvs, blocks.DOWN, fit)
    assert capped.simds == plain.simds and capped.xchunk == plain.xchunk
    for kind, (n, k) in gemvs.items():
        r, p, tickets = capped.gemvs[kind]
        assert (r, p) == plain.gemvs[kind][:2]
        if kind == blocks.DOWN:
            assert tickets == plain.gemvs[kind][2]
        else:
            assert tickets == min(plain.gemvs[kind][2], fit)


@pytest.mark.parametrize("below", [64, 256, 100_000])
@pytest.mark.parametrize("shape", LAYERS)
def test_narrow_phases_halve_their_rows_until_they_have_the_tickets(shape, below):
    """block_narrow: a GEMV phase (not gate|up) with fewer tickets than asked halves its rows a
    SIMD group until it has them or takes one row; its tickets are then its row groups, every row
    covered; the others keep theirs."""
    d, n_qkv, hd, f = shape
    gemvs = {blocks.UP: (2 * f, d), blocks.DOWN: (d, f), blocks.QKV: (n_qkv, d), blocks.O: (d, hd)}
    plain = blocks.block_geometry("q8_0", 1, gemvs, blocks.DOWN)
    narrow = blocks._narrowed(plain, gemvs, below)
    assert narrow.gemvs[blocks.UP] == plain.gemvs[blocks.UP]
    for kind, (n, _) in gemvs.items():
        (r0, p0, t0), (r, p, t) = plain.gemvs[kind], narrow.gemvs[kind]
        assert p == p0
        if kind == blocks.UP or t0 >= below:
            assert (r, t) == (r0, t0)
        else:
            assert r < r0 and (t >= below or r == 1) and r0 % r == 0
            assert t == -(-n // (r * plain.simds))


def test_block_nsimd_sets_the_threadgroup_size():
    from kernels import options

    gemvs = {blocks.UP: (2 * 14336, 4096), blocks.DOWN: (4096, 14336)}
    saved = gemv.TUNING["BLOCK_NSIMD"]
    try:
        for simds in (4, 8):
            gemv.set_tuning(f"BLOCK_NSIMD={simds}")
            with options.use(block_geometry="per_gemv"):
                geo = blocks.block_geometry("q4_0", 1, gemvs, blocks.DOWN)
            # gate|up's cap kept in SIMD groups: 528 threadgroups of 4 on their own
            assert geo.simds == simds and geo.gemvs[blocks.UP][2] == 528 * 4 // simds
    finally:
        gemv.set_tuning(f"BLOCK_NSIMD={saved}")


def test_token_block_over_two_block_types_marks_each_layer():
    """llama.cpp's Q4_K_M: attn_v and ffn_down Q6_K in some layers, Q4_K elsewhere. token_block
    makes one launch whose V rows are a matrix of their own (w_v), each GEMV's two types in the
    prelude (A the type of most layers), and a layer_types word a layer with the bits of its
    matrices of type B (layer_block.metal)."""
    from kernels.runtime import recording

    d, f, hq, hkv, hd = 256, 256, 4, 2, 64  # K-quant rows: K a multiple of 256 everywhere
    v_types, down_types = ("q4_k", "q6_k", "q4_k"), ("q6_k", "q4_k", "q4_k")
    norm = mx.ones((3, d), mx.float16)
    stacks = blocks.LayerStacks(
        norm, blocks.Stack([_packed((hq + hkv) * hd, d, i, "q4_k") for i in range(3)]),
        blocks.Stack([_packed(d, hq * hd, i, "q4_k") for i in range(3)]), norm,
        blocks.Stack([_packed(2 * f, d, i, "q4_k") for i in range(3)]),
        blocks.Stack([_packed(d, f, i, t) for i, t in enumerate(down_types)]),
        w_v=blocks.Stack([_packed(hkv * hd, d, i, t) for i, t in enumerate(v_types)]))
    kv = [mx.zeros((hkv, 16, hd), mx.float16) for _ in range(3)]
    with recording() as rec:
        blocks.token_block(mx.zeros((1, d), mx.float16), stacks, 1e-6, "q4_k", kv, list(kv), 3, n_heads=hq)
    (job,) = rec.jobs
    inputs = dict(zip(job.spec.inputs, job.inputs))
    assert np.array(inputs["layer_types"]).tolist() == [1 << blocks.DOWN, 1 << blocks.V, 0]
    assert inputs["w_v"] is stacks.w_v.data and np.array(inputs["v_dims"])[:2].tolist() == [hkv * hd, d]
    for kind, a, b in (("QKV", 2, 2), ("V", 2, 4), ("O", 2, 2), ("UP", 2, 2), ("DOWN", 2, 4)):
        assert f"#define Q_{kind}_A {a}\n#define Q_{kind}_B {b}\n" in job.spec.prelude
    assert "#define QKV_SPLIT 1" in job.spec.prelude and job.constants["W_V_STRIDE"] == stacks.w_v.stride


def test_token_block_takes_gemmas_layer():
    """Gemma's layer (LayerKind): one token_block launch with the post-norms, each layer's window
    and RoPE table, GELU, a float32 stream; then the last post-norm's launch."""
    from kernels.runtime import recording

    tables = mx.zeros((2, HD // 2), mx.float32)
    with recording() as rec:
        x = _token(_gemma_stacks(), x=mx.zeros((1, D), mx.float32), layer_kind=GEMMA, windows=[4, 0],
                   inv_freqs=tables, scale=0.1)[0]
    block, post = rec.jobs
    assert block.spec.name.startswith("lathe_token_block_10_post_win_gelu") and post.spec.name == "lathe_post_norm_add"
    for line in ("POST_NORMS 1", "LAYER_WINDOWS 1", "LATHE_ACT 1", "LATHE_SOFTCAP 0"):
        assert f"#define {line}\n" in block.spec.prelude
    named = dict(zip(block.spec.inputs, block.inputs))
    assert np.array(named["windows"]).tolist() == [4, 0] and named["inv_freqs"] is tables
    assert np.array(named["scale"]).tolist() == pytest.approx([0.1]) and block.constants["ROPE_STRIDE"] == HD // 2
    assert dict(zip(block.spec.outputs, block.outputs))["x_out"][1] == mx.float32 and x.dtype == mx.float32


def test_blocks_take_q8_0_beside_the_other_types():
    """A Q8_0 matrix beside a Q4_0 one in a launch: X' is laid out for the launch's type (Q4_0's
    32-value chunks) and the Q8_0 GEMV reads it in its own 16-value chunks (v3_rows.metal)."""
    from kernels.runtime import recording

    x, norm = mx.zeros((1, 256), mx.float16), mx.ones((256,), mx.float16)
    with recording() as rec:
        blocks.ffn_block(x, norm, 1e-6, _packed(512, 256, 0, "q4_0"), _packed(256, 256, 1), "q4_0")
    (job,) = rec.jobs
    assert job.constants["QTYPE"] == 0 and "#define Q_DOWN_A 1\n" in job.spec.prelude


def test_token_block_takes_a_pair_of_types_a_projection():
    """Four block types over a token's stacks (Q4_0 attention, Q4_K gate|up, Q6_K and Q4_K
    down, a Q8_0 output projection) is fine: each GEMV takes its own pair."""
    from kernels.runtime import recording

    d, f, hq, hkv, hd = 256, 256, 4, 2, 64
    norm = mx.ones((2, d), mx.float16)

    def stacks(o_type: str) -> blocks.LayerStacks:
        return blocks.LayerStacks(
            norm, blocks.Stack([_packed((hq + 2 * hkv) * hd, d, i, "q4_0") for i in range(2)]),
            blocks.Stack([_packed(d, hq * hd, i, o_type) for i in range(2)]), norm,
            blocks.Stack([_packed(2 * f, d, i, "q4_k") for i in range(2)]),
            blocks.Stack([_packed(d, f, i, t) for i, t in enumerate(("q6_k", "q4_k"))]))

    kv = [mx.zeros((hkv, 16, hd), mx.float16) for _ in range(2)]
    with recording() as rec:
        blocks.token_block(mx.zeros((1, d), mx.float16), stacks("q4_0"), 1e-6, "q4_0", kv, list(kv), 3, n_heads=hq)
    # down: Q6_K in layer 0, Q4_K in layer 1, a tie: type A is layer 0's
    assert len(rec.jobs) == 1 and "#define Q_DOWN_A 4\n#define Q_DOWN_B 2\n" in rec.jobs[0].spec.prelude
    with recording() as rec:
        blocks.token_block(mx.zeros((1, d), mx.float16), stacks("q8_0"), 1e-6, "q4_0", kv, list(kv), 3, n_heads=hq)
    assert len(rec.jobs) == 1 and "#define Q_O_A 1\n" in rec.jobs[0].spec.prelude


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k"])
def test_the_blocks_checks_draw_k_weights_of_mean_zero(qtype):
    """The blocks' checks chain layers, so their random K-quant weights must average zero as a real
    layer's do (harness.suites.gemv._k_blocks(centered=True)): random mins give the weights a mean
    close to their spread, and two 8B-wide layers then overflowed fp16. The levels and
    scales stay random; only each min follows its scale."""
    from harness.suites.gemv import _k_blocks

    n, k = 64, 1024
    plain = kquant.dequantize(_k_blocks(np.random.default_rng(0), qtype, n, k), qtype, k).astype(np.float64)
    data = _k_blocks(np.random.default_rng(0), qtype, n, k, centered=True)
    centered = kquant.dequantize(data, qtype, k).astype(np.float64)
    assert abs(plain.mean()) > 0.2 * plain.std()  # what the plain draw gives (a check that can fail)
    assert abs(centered.mean()) < 0.02 * centered.std()
    # each sub-block's 32 weights about zero on average (levels are uniform: mean 0 +- their spread)
    sub = centered.reshape(-1, 32)
    assert np.abs(sub.mean(axis=1)).mean() < 0.5 * sub.std(axis=1).mean()
    sc, mn = kquant.unpack_scales_mins(data.reshape(-1, kquant.BLOCK_BYTES[qtype])[:, 4:16])
    assert np.array_equal(sc, mn) and len(np.unique(sc)) == 64  # random 6-bit scales, mins tied to them


def _one_layer(d: int, f: int, heads: tuple[int, int, int]) -> blocks.LayerStacks:
    """One layer's stacks at these widths (`heads`: query heads, kv heads, their size), Q8_0."""
    hq, hkv, hd = heads
    norm = mx.ones((1, d), mx.float16)
    return blocks.LayerStacks(norm, blocks.Stack([_packed((hq + 2 * hkv) * hd, d, 0)]),
                              blocks.Stack([_packed(d, hq * hd, 1)]), norm,
                              blocks.Stack([_packed(2 * f, d, 2)]), blocks.Stack([_packed(d, f, 3)]))


def _token_block_job(max_seq: int, d: int = 1024, f: int = 3072, heads: tuple[int, int, int] = (4, 2, 64),
                     **setting):
    """The recorded launch of a one-layer token_block (`heads`: query heads, kv heads, their
    size) over a cache of max_seq rows, the position on the device (as the decode loop passes it:
    the launch is sized for the whole cache). The default widths are Qwen3-0.6B's: 4 SIMD groups a
    threadgroup."""
    from kernels import options
    from kernels.runtime import recording

    hq, hkv, hd = heads
    stacks = _one_layer(d, f, heads)
    kv = [mx.zeros((hkv, max_seq, hd), mx.float16)]
    with options.use(**setting), recording() as rec:
        blocks.token_block(mx.zeros((1, d), mx.float16), stacks, 1e-6, "q8_0", kv, list(kv),
                           mx.array([5], mx.int32), n_heads=hq)
    (job,) = rec.jobs
    return job


def _attention_slots(max_seq: int, **setting) -> tuple[int, int, int]:
    """(KSLOTS, MMA, NSIMD) of _token_block_job's launch."""
    c = _token_block_job(max_seq, **setting).constants
    return c["KSLOTS"], c["MMA"], c["NSIMD"]


def test_the_blocks_attention_takes_k_slots_where_it_splits_the_context():
    """block_k_slots auto: K through threadgroup memory in one slot, with the MMA form where D fits
    the SIMD groups wherever the launch splits the context (past block_split_from tokens and one
    partition), without it where one ticket takes a kv head's whole context (the megafused A/Bs of
    kernels/loop/NOTES.md); a setting is taken as given where the threadgroup memory holds it."""
    from kernels import options

    _, _, nsimd = _attention_slots(64)
    edge = options.get("block_split_from")
    mma = int(64 <= 32 * nsimd)
    assert _attention_slots(edge // 2)[:2] == (1, 0)
    assert _attention_slots(edge)[:2] == (1, 0)
    assert _attention_slots(edge + 1)[:2] == (1, mma)
    assert _attention_slots(64 * 32 * nsimd + 1)[:2] == (1, mma)
    assert _attention_slots(edge + 1, block_split_from=4 * edge)[:2] == (1, 0)  # unsplit: one, no MMA
    assert _attention_slots(4 * edge, block_k_slots=0)[:2] == (0, 0)
    assert _attention_slots(4 * edge, block_k_slots=2)[:2] == (2, mma)
    assert _attention_slots(4 * edge, block_attn_mma=False)[:2] == (1, 0)
    assert _attention_slots(edge // 2, block_k_slots=1)[:2] == (1, mma)
    with pytest.raises(ValueError, match="block_k_slots must be 0, 1 or 2"):
        _attention_slots(64, block_k_slots=3)


def test_k_slots_go_into_x_where_no_room_is_left_beside_it():
    """block_k_in_x: where the GEMVs' staged X' leaves no room for a K slot beside it (the 8B's FFN,
    K 14336 a chunk), the slot goes in X' itself: KIN_X, and the launch's threadgroup memory counts
    it once. Where a slot fits beside (Qwen3's widths), nothing moves."""
    from kernels import attention, backends

    for max_seq in (64, 8192):  # unsplit, then split over partitions
        plain = _token_block_job(max_seq, 4096, 14336, block_k_in_x=False).constants
        assert (plain["KSLOTS"], plain["KIN_X"]) == (0, 0)
        c = _token_block_job(max_seq, 4096, 14336, block_k_in_x=True).constants
        assert (c["KSLOTS"], c["KIN_X"]) == (1, 1)
        assert c["XCHUNK"] == plain["XCHUNK"] == 14336 and c["MMA"] == int(max_seq > 512)
        assert attention.k_slot_bytes(c["D"], c["NSIMD"]) <= 2 * c["M"] * c["XCHUNK"]  # layer_block's static_assert
        split = max_seq > 512
        assert (blocks._threadgroup_bytes(c, True, False, split) - blocks._threadgroup_bytes(plain, True, False, split)
                == (2 * 8 * (64 + 8) - 2 if c["MMA"] else 0))  # no slot's bytes: only MMA's fp16 Q
        assert blocks._threadgroup_bytes(c, True, False, split) <= backends.threadgroup_memory()
    c = _token_block_job(8192, block_k_in_x=True).constants
    assert (c["KSLOTS"], c["KIN_X"]) == (1, 0)


def test_min_groups_bound_the_token_block_for_that_many_threadgroups_an_sm():
    """block_min_groups: the token block's spec carries launch bounds of its own threadgroup (32 x
    NSIMD threads) and the setting, and its CUDA header declares them (the one __global__ after
    it); 0 leaves the compiler its choice. A launch of more threads than the bounds is refused."""
    import dataclasses

    from kernels.runtime import LaunchLimitError, check_launch, handed_sources

    from kernels import options

    def header(spec, cuda=True) -> str:  # the text MLX gets (inline_source: not an include line)
        with options.use(inline_source=True):
            return handed_sources(spec, True, cuda=cuda)[1]

    plain = _token_block_job(64, block_min_groups=0)
    assert plain.spec.launch_bounds is None
    assert "__launch_bounds__" not in header(plain.spec)
    assert _token_block_job(64).spec.launch_bounds == (128, blocks.MIN_GROUPS_AUTO)  # auto: below
    for least in (3, 4):
        job = _token_block_job(64, block_min_groups=least)
        threads = 32 * job.constants["NSIMD"]
        assert job.spec.launch_bounds == (threads, least) and job.threadgroup == (threads, 1, 1)
        assert job.constants == plain.constants
        assert header(job.spec).endswith(f"#define __global__ __location__(global) __launch_bounds__({threads}, {least})\n")
        assert "__launch_bounds__" not in header(job.spec, cuda=False)  # Metal: no such bound
    check_launch(job)  # (a CUDA launch's limits off Metal: CI's CPU too)
    wide = dataclasses.replace(job, threadgroup=(2 * threads, 1, 1), grid=(2 * threads, 1, 1))
    with pytest.raises(LaunchLimitError, match="past its launch bounds"):
        check_launch(wide)


def test_min_groups_auto_bounds_only_the_plain_token_block():
    """block_min_groups auto: 4 an SM for a token block of 4 SIMD groups whose attention has no head
    norms, no post norms, heads up to 128, the contiguous caches and not the MMA form (what was
    measured on the 8B); the compiler's choice for the named halves, the paged batch form, the
    prompt form's rows, the MMA
    form, Qwen3's head norms, Gemma's post norms and heads of 256, and other threadgroup sizes. A
    setting overrides the rule."""
    from types import SimpleNamespace

    from kernels import options

    def attn(**kw):
        return SimpleNamespace(**{**dict(norms=(), table=None, head_dim=128, batch=1), **kw})

    token, gemma = (blocks.QKV, 10), blocks.LayerKind(post_norms=True)
    assert blocks.min_groups(*token, 4, attn(), blocks.LLAMA) == blocks.MIN_GROUPS_AUTO == 4
    assert blocks.min_groups(*token, 4, attn(head_dim=64), blocks.LLAMA) == 4
    for first, phases, simds, a, kind in (
            (blocks.QKV, 3, 4, attn(), blocks.LLAMA), (blocks.UP, 2, 4, None, blocks.LLAMA),
            (blocks.UP, 5, 4, attn(), blocks.LLAMA), (*token, 4, attn(norms=("q", "k")), blocks.LLAMA),
            (*token, 4, attn(table="paged"), blocks.LLAMA), (*token, 4, attn(batch=8), blocks.LLAMA),
            (*token, 4, attn(), gemma),
            (*token, 4, attn(head_dim=256), blocks.LLAMA), (*token, 8, attn(), blocks.LLAMA)):
        assert blocks.min_groups(first, phases, simds, a, kind) == 0, (first, phases, simds, a, kind)
    assert blocks.min_groups(*token, 4, attn(), blocks.LLAMA, mma=True) == 0
    # as launched: the split token block with K's slot takes the MMA form, and no bounds (Qwen3's
    # widths without head norms here); unsplit, neither
    split, unsplit = _token_block_job(8192), _token_block_job(64)
    assert (split.constants["MMA"], split.spec.launch_bounds) == (1, None)
    assert (unsplit.constants["MMA"], unsplit.spec.launch_bounds) == (0, (128, 4))
    with options.use(block_min_groups=3):
        assert blocks.min_groups(*token, 4, attn(norms=("q", "k")), blocks.LLAMA) == 3
    with options.use(block_min_groups=0):
        assert blocks.min_groups(*token, 4, attn(), blocks.LLAMA) == 0


def test_x_is_staged_in_chunks_where_the_row_does_not_fit_beside_attention():
    """A down row past what fits beside attention's arrays (K = 24576 at 2.25 bytes a value of X'
    passes the 48 KiB a CUDA threadgroup may declare): token_block stages X' in chunks of 2048
    values (its spec counts the bytes). Qwen2.5-7B's (K = 18944) fits whole beside one query head a
    threadgroup (kernels.blocks.heads_split), as Llama-3-8B's layer (K = 14336) does."""
    from kernels.backends import threadgroup_memory
    from kernels.runtime import recording

    def launch(d, f, hq, hkv):
        st = blocks.LayerStacks(mx.ones((1, d), mx.float16), blocks.Stack([_packed((hq + 2 * hkv) * 128, d, 0, "q4_0")]),
                                blocks.Stack([_packed(d, hq * 128, 1, "q4_0")]), mx.ones((1, d), mx.float16),
                                blocks.Stack([_packed(2 * f, d, 2, "q4_0")]), blocks.Stack([_packed(d, f, 3, "q4_0")]))
        kv = [mx.zeros((hkv, 64, 128), mx.float16)]
        with recording() as rec:
            blocks.token_block(mx.zeros((1, d), mx.float16), st, 1e-6, "q4_0", kv, list(kv), 3, n_heads=hq)
        (job,) = rec.jobs
        return job.constants["XCHUNK"], job.spec.threadgroup_bytes(job.constants)

    xchunk, used = launch(512, 24576, 4, 2)
    assert xchunk < 24576 and xchunk % 2048 == 0 and used <= threadgroup_memory()
    assert launch(3584, 18944, 28, 4)[0] == 18944
    assert launch(4096, 14336, 32, 8)[0] == 14336


@pytest.mark.parametrize("most, want", [(0, 14336), (4096, 4096), (6144, 6144), (16384, 14336)])
def test_block_xchunk_caps_the_staged_chunk(most, want):
    """block_xchunk: the blocks' X' chunk at most that many values (0: the longest K, which fits
    here); the K = 4096 phases keep their capped tickets where one chunk still holds their row."""
    from kernels import options

    gemvs = {blocks.UP: (2 * 14336, 4096), blocks.DOWN: (4096, 14336), blocks.QKV: (6144, 4096), blocks.O: (4096, 4096)}
    with options.use(block_xchunk=most):
        geo = blocks.block_geometry("q4_0", 1, gemvs, blocks.DOWN, fit=396)
    assert geo.xchunk == want
    assert all(tickets <= 396 for kind, (_, _, tickets) in geo.gemvs.items() if kind != blocks.DOWN)


def test_block_phases_sets_a_phases_rows_loads_and_tickets_by_hand():
    """block_phases: down_r=4 gives down 16-row tickets (256 for the 8B's 4096 rows), down_t a cap
    under which its SIMD groups stream row groups, p the loads in flight; the other phases keep
    theirs. A wrong key, an odd up_r, or a cap where K is staged in chunks is refused before any
    launch (launches recorded)."""
    gemvs = {blocks.UP: (2 * 14336, 4096), blocks.DOWN: (4096, 14336), blocks.QKV: (6144, 4096), blocks.O: (4096, 4096)}
    geo = blocks.block_geometry("q4_0", 1, gemvs, blocks.DOWN)
    (r, p, tickets) = geo.gemvs[blocks.DOWN]
    assert (r, tickets) == (2, 4096 // (2 * geo.simds))
    by_hand = lambda setting: blocks._by_hand(geo, gemvs, setting).gemvs  # noqa: E731
    assert by_hand("")[blocks.DOWN] == (r, p, tickets)
    assert by_hand("down_r=4")[blocks.DOWN] == (4, p, 4096 // (4 * geo.simds))
    assert by_hand("down_r=4+down_p=2")[blocks.DOWN] == (4, 2, 4096 // (4 * geo.simds))
    assert by_hand("down_t=256")[blocks.DOWN] == (2, p, 256)
    assert by_hand("DOWN_T=100000")[blocks.DOWN] == (2, p, tickets)  # never more than its row groups
    assert {k: v for k, v in by_hand("down_r=4").items() if k != blocks.DOWN} == {
        k: v for k, v in geo.gemvs.items() if k != blocks.DOWN}
    from kernels import options
    from kernels.runtime import recording

    for setting, message in [("gate_r=2", "KIND_r"), ("down_x=2", "KIND_r"), ("down_r=0", "positive"),
                             ("up_r=3", "even"), ("down_p=17", "at most 16")]:
        with options.use(block_phases=setting), recording() as rec, pytest.raises(ValueError, match=message):
            _token()
        assert rec.jobs == []
    chunked = blocks.BlockGeometry(geo.simds, 4096, geo.gemvs)
    with pytest.raises(ValueError, match="one X' chunk"):
        blocks._by_hand(chunked, gemvs, "down_t=128")


def test_two_passes_halve_a_single_tokens_long_rows_where_the_context_is_unsplit():
    """block_two_passes: a single token's phase whose lanes take 4 or more passes over a row at its
    P takes two where 7 loads at once or fewer do it: the 8B Q4_0's down (14 loads a lane) 4 -> 7.
    Llama-2-7B's (11 loads, 3 passes), the Q8_0 8B's (28: 7 passes, 4 at P 7) and Qwen3's (6 at P
    2) keep theirs (each measured slower or level), as do the 8B's K = 4096 phases. Split
    contexts, M > 1 and the option off keep the geometry's (launches recorded)."""
    gemvs = {blocks.UP: (2 * 14336, 4096), blocks.DOWN: (4096, 14336), blocks.QKV: (6144, 4096), blocks.O: (4096, 4096)}
    geo = blocks.block_geometry("q4_0", 1, gemvs, blocks.DOWN)
    assert {kind: p for kind, (_, p, _) in geo.gemvs.items()} == dict.fromkeys(gemvs, 4)
    wide = blocks._two_passes(geo, gemvs, "q4_0").gemvs
    assert wide[blocks.DOWN] == (geo.gemvs[blocks.DOWN][0], 7, geo.gemvs[blocks.DOWN][2])
    assert {k: v for k, v in wide.items() if k != blocks.DOWN} == {k: v for k, v in geo.gemvs.items() if k != blocks.DOWN}
    for qtype, down in [("q4_0", (4096, 11008)), ("q8_0", (4096, 14336)), ("q8_0", (4096, 7168))]:
        one = {blocks.DOWN: down}
        g = blocks.block_geometry(qtype, 1, one, blocks.DOWN)
        assert blocks._two_passes(g, one, qtype).gemvs[blocks.DOWN][1] == (7 if down[1] == 7168 else 4)

    def p_down(max_seq: int, f: int = 7168, **setting) -> int:  # Q8_0: K = 7168 is 14 loads a lane
        return _token_block_job(max_seq, 4096, f, **setting).constants["P_DOWN"]

    assert p_down(64) == 7 and p_down(64, block_two_passes=False) == 4
    assert p_down(64, 14336) == 4  # 28 loads: 4 passes even at 7
    assert p_down(8192) == 4  # split over partitions: that module spills at 7
    assert p_down(64, block_phases="down_p=5") == 5  # by hand, after the rule
    assert _token_block_job(64).constants["P_DOWN"] == 2  # Qwen3-0.6B's down: 6 loads a lane, 3 passes


def test_prefetch_is_a_bit_a_gemv_kind_less_the_skipped_ones():
    """block_prefetch and block_prefetch_skip: PREFETCH holds bit kind for each GEMV phase that issues
    its first weights before its wait (layer_block.metal's PREFETCH_OF); none with block_prefetch
    off; a kind that is not a GEMV phase's is refused when the option is parsed."""
    from kernels import options

    every = (1 << blocks.QKV) | (1 << blocks.O) | (1 << blocks.UP) | (1 << blocks.DOWN)
    assert _token_block_job(64).constants["PREFETCH"] == every
    assert _token_block_job(64, block_prefetch_skip="o").constants["PREFETCH"] == every & ~(1 << blocks.O)
    skipped = _token_block_job(64, block_prefetch_skip="down+qkv").constants["PREFETCH"]
    assert skipped == (1 << blocks.O) | (1 << blocks.UP)
    assert _token_block_job(64, block_prefetch=False, block_prefetch_skip="o").constants["PREFETCH"] == 0
    assert options.parse("block_prefetch_skip=down+qkv+down") == {"block_prefetch_skip": "qkv+down"}
    with pytest.raises(ValueError, match="GEMV kinds"):
        options.parse("block_prefetch_skip=attn")


def test_block_xchunk_off_the_2048_grid_is_refused_before_launch():
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_xchunk=3000), recording() as rec, pytest.raises(ValueError, match="multiple of 2048"):
        _token()
    assert rec.jobs == []


@pytest.mark.parametrize("group, want", [(1, 1), (4, 1), (7, 7), (6, 2), (8, 2), (5, 5)])
def test_a_blocks_attention_threadgroup_takes_at_most_four_query_heads(group, want):
    """Its sums set the registers of the whole launch (kernels.blocks.BLOCK_HEADS), so a group of
    more heads is shared out over a divisor of it, whatever the grid (a context split in many
    partitions included)."""
    assert blocks.heads_split(group) == want


@pytest.mark.parametrize("target", ["cuda", "metal"])
def test_token_block_takes_every_layers_cache_in_one_stack(target):
    """mega_kv_stacked: K and V of every layer each in one array [layers, Hkv, max_seq, D]. On
    CUDA the launch takes the two stacks as its only cache inputs and reads layer l at l * Hkv *
    max_seq * D (decode attention's dims); on Metal each layer's phases write a view of the
    stack. Either way the stacks come back, ordered after the writes (launches recorded, no GPU)."""
    from kernels.runtime import recording

    k, v = (mx.zeros((2, HKV, 16, HD), mx.float16) for _ in "kv")
    with recording(target) as rec:
        x, k_out, v_out = blocks.token_block(mx.zeros((1, D), mx.float16), _stacks(), 1e-6, "q8_0", k, v, 3,
                                             n_heads=HQ)
    assert tuple(k_out.shape) == tuple(v_out.shape) == (2, HKV, 16, HD) and tuple(x.shape) == (1, D)
    if target == "cuda":
        (job,) = rec.jobs
        inputs = dict(zip(job.spec.inputs, job.inputs))
        assert inputs["k_cache_0"] is k and inputs["v_cache_0"] is v and "k_cache_1" not in inputs
        assert "_stacked" in job.spec.name and job.spec.in_place == ("k_cache_0", "v_cache_0")
        assert "#define LATHE_K_CACHE(l) (k_cache_0 + size_t(l) * uint(dims[0]) * uint(dims[1]) * D)" in job.spec.prelude
        assert np.array(inputs["dims"])[:2].tolist() == [HKV, 16]
    else:  # each layer's attention launch writes a view of layer l's rows
        written = [j for j in rec.jobs if "k_cache" in j.spec.inputs]
        assert len(written) == 2
        for job in written:
            assert tuple(dict(zip(job.spec.inputs, job.inputs))["k_cache"].shape[-3:]) == (HKV, 16, HD)
    with recording(target), pytest.raises(ValueError, match="both be lists"):
        blocks.token_block(mx.zeros((1, D), mx.float16), _stacks(), 1e-6, "q8_0", k, [v[0], v[1]], 3, n_heads=HQ)
    with recording(target), pytest.raises(ValueError, match=r"stacked k_caches must be \[2, Hkv"):
        blocks.token_block(mx.zeros((1, D), mx.float16), _stacks(), 1e-6, "q8_0", k[:1], v[:1], 3, n_heads=HQ)


@pytest.mark.parametrize("shape", LAYERS)
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("fit", [None, 264, 528])
def test_block_balance_lowers_the_most_rows_a_simd_group_streams(shape, qtype, fit):
    """block_balance: a capped GEMV phase (its SIMD groups streaming row groups) takes fewer rows a
    row group where that lowers the most rows any SIMD group takes, never more; gate|up, whose
    rows pair, and uncapped phases keep theirs. Llama-3-8B's QKV at the H200's fit (528 tickets of
    4 SIMD groups): 2 rows of 3072 groups give some SIMD groups 4 rows, 1 row of 6144 at most 3."""
    d, n_qkv, hd, f = shape
    gemvs = {blocks.UP: (2 * f, d), blocks.DOWN: (d, f), blocks.QKV: (n_qkv, d), blocks.O: (d, hd)}
    geo = blocks.block_geometry(qtype, 1, gemvs, blocks.DOWN, fit)
    even = blocks._balanced(geo, gemvs)

    def most(g, kind):
        r, _, tickets = g.gemvs[kind]
        return r * -(-(-(-gemvs[kind][0] // r)) // (tickets * g.simds))

    for kind, (r, p, tickets) in geo.gemvs.items():
        r2, p2, tickets2 = even.gemvs[kind]
        assert (p2, tickets2) == (p, tickets) and r2 <= r and most(even, kind) <= most(geo, kind)
        if kind == blocks.UP or tickets * r * geo.simds >= gemvs[kind][0]:
            assert r2 == r
    if shape == LAYERS[2] and fit == 528:
        assert geo.gemvs[blocks.QKV][0] == 2 and even.gemvs[blocks.QKV][0] == 1
        assert (most(geo, blocks.QKV), most(even, blocks.QKV)) == (4, 3)


def test_a_stacks_layer_views_share_its_bytes():
    """kernels.runtime.layer_views: layer i of a stack of caches is a view of the stack's buffer at
    i x a layer's bytes (a kernel writing through it writes the stack), where MLX's `stack[i]` is
    a gather into a copy of its own (the buffers' addresses, on the CPU)."""
    from kernels.runtime import layer_views

    stack = mx.zeros((3, HKV, 16, HD), mx.float16)
    mx.eval(stack)

    def address(a):
        return np.asarray(memoryview(a)).__array_interface__["data"][0]

    layer = HKV * 16 * HD * 2
    assert [address(v) - address(stack) for v in layer_views(stack, "stack")] == [0, layer, 2 * layer]
    assert address(stack[1]) - address(stack) != layer  # the gather MLX makes of an integer index


def test_the_attention_phase_fills_the_threadgroups_its_bound_keeps_resident(monkeypatch):
    """attn_split_grid auto in a token block bound to N threadgroups an SM: its partitions aim at
    N times the SMs. The 8B's token at 16384 + 200 rows on 132 SMs: 65 partitions of 2 chunks a
    kv head (520 tickets for 528 threadgroups, merged 3 a lane) where SPLIT_GRID's 512 made 44 of
    3. Unbound, set, or with no SMs to go by (a recording), SPLIT_GRID stays; the merge's weights
    take no room from the staged X'."""
    from kernels import backends, runtime

    def layout(**setting) -> tuple[int, dict]:
        job = _token_block_job(16584, 4096, 14336, (32, 8, 128), **setting)
        return int(np.array(dict(zip(job.spec.inputs, job.inputs))["dims"])[3]), job.constants

    parts, recorded = layout()
    assert (parts, recorded["MLANE"]) == (44, 2)
    monkeypatch.setattr(runtime, "sm_count", lambda: 132)
    parts, c = layout()
    assert (parts, c["MLANE"], c["MLOADS"], c["XCHUNK"]) == (65, 3, 16, recorded["XCHUNK"])
    assert blocks._threadgroup_bytes(c, True, False, True) <= backends.threadgroup_memory()
    assert layout(attn_split_grid=512)[0] == 44
    assert layout(block_min_groups=0)[0] == 44
    assert layout(block_min_groups=3)[0] == 44  # 396 threadgroups: 49 partitions of 2 would not fit
    monkeypatch.setattr(runtime, "sm_count", lambda: 66)  # half the SMs: 33 partitions of 4 chunks
    assert layout()[0] == 33


def test_the_attention_phase_splits_query_heads_to_fill_its_bound_wave(monkeypatch):
    """attn_query_split auto in a token block bound to N threadgroups an SM: a kv head's query
    heads go to as many tickets as keep every partition's but the last (the cache's unfilled
    rows) within N times the SMs. The 8B's token at 4096 + 144 rows on 132 SMs: 34 partitions of a
    chunk, its 4 query heads over 2 tickets (528 for the first 33 partitions' 8 kv heads); at
    16384 + 200 rows (65 partitions) and unsplit, what attention's bound of 64 gives; unbound,
    set, or with no SMs to go by (a recording), attention's bound."""
    from kernels import runtime

    def split(rows: int, **setting) -> tuple[int, int]:
        c = _token_block_job(rows, 4096, 14336, (32, 8, 128), **setting).constants
        return c["QS"], c["G"]

    assert split(4240) == (1, 4)  # a recording: no SMs
    monkeypatch.setattr(runtime, "sm_count", lambda: 132)
    assert split(4240) == (2, 2)
    assert split(4250) == (2, 2) and split(4360) == (1, 4)  # 34 full partitions: 544 tickets
    assert split(16584) == (1, 4)
    assert split(300) == (4, 1)  # unsplit: 8 tickets of 4 heads would leave the GPU idle
    assert split(4240, block_min_groups=0) == (1, 4)
    assert split(4240, attn_query_split=64) == (1, 4)
    assert split(4240, attn_query_split=600) == (2, 2)


@pytest.mark.parametrize("split_from, split", [(None, True), (256, True), (2048, False)])
def test_block_split_from_sets_where_token_blocks_attention_splits(split_from, split):
    """block_split_from: token_block's attention phase splits a context past this many tokens
    (and past one partition) over tickets merged in the launch; unsplit it is one ticket a kv
    head. At 1000 tokens the default (512) splits it, 2048 keeps it whole (launches recorded, no
    GPU)."""
    from kernels import options
    from kernels.runtime import recording

    kv = [mx.zeros((HKV, 1100, HD), mx.float16) for _ in range(2)]
    with options.use(**({} if split_from is None else {"block_split_from": split_from})), recording() as rec:
        blocks.token_block(mx.zeros((1, D), mx.float16), _stacks(), 1e-6, "q8_0", kv, list(kv), 1000, n_heads=HQ)
    (job,) = rec.jobs
    assert ("_split" in job.spec.name) == split
    parts = np.array(dict(zip(job.spec.inputs, job.inputs))["dims"])[3]
    assert (parts > 1) == split


@pytest.mark.parametrize("apart", [False, True])
def test_block_signal_apart_is_the_launchs_constant(apart):
    """block_signal_apart: layer_block.metal's SIGNAL_APART, a ticket's done signalled by another
    thread than the next claim's (a constant of the module: both forms compiled apart; launches
    recorded)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_signal_apart=apart), recording() as rec:
        _token()
    (job,) = rec.jobs
    assert job.constants["SIGNAL_APART"] is apart


@pytest.mark.parametrize("setting, bound", [("row", True), ("launch", False)])
def test_gemv_row_passes_is_the_launchs_constant(setting, bound):
    """gemv_row_passes: layer_block.metal's ROW_PASSES (v3_rows' GEMV_ROW_PASSES), each GEMV
    phase's passes bounded by its own row or by the launch's X' chunk (launches recorded)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(gemv_row_passes=setting), recording() as rec:
        _token()
    (job,) = rec.jobs
    assert job.constants["ROW_PASSES"] is bound


@pytest.mark.parametrize("marks, stamps", [(False, 3), (True, blocks.TIMELINE_STAMPS)])
def test_a_timeline_stamps_three_times_a_ticket_or_six_with_the_marks(monkeypatch, marks, stamps):
    """token_block's timeline (launches recorded, the CUDA path stood in): each ticket's row takes
    3 stamps, or TIMELINE_STAMPS with block_timeline_marks (the module compiled with them, under a
    name of its own), then a row a threadgroup of the launch (their own three); BlockTimeline gets
    the launch's kinds, tickets and threadgroups."""
    from kernels import options
    from kernels.runtime import recording

    monkeypatch.setattr(blocks.backends, "cross_group_waits", lambda: True)
    timeline = []
    with options.use(block_timeline_marks=marks), recording() as rec:
        _token(timeline=timeline)
    (job,) = rec.jobs
    assert f"#define TIMELINE_STAMPS {stamps}\n" in job.spec.prelude and job.spec.name.endswith(f"_timeline{stamps}")
    (tl,) = timeline
    groups = job.grid[0] // job.threadgroup[0]
    assert tuple(tl.stamps.shape) == (sum(tl.tickets) + groups, stamps, 3) and len(tl.kinds) == len(tl.tickets) == 10
    assert tl.groups == groups and tl.array().shape[0] == sum(tl.tickets) and tl.group_stamps().shape == (groups, 3, 3)


def _paged_batch(pos=(5, 20, 0)):
    """token_block's batch form over a paged pool (serve's megafused step), recorded by the caller."""
    from harness.suites.attention import _paged_state

    k_pool, v_pool, table = _paged_state(np.random.default_rng(2), [p + 1 for p in pos], HKV, HD, 16)
    return blocks.token_block(mx.zeros((len(pos), D), mx.float16), _stacks(1), 1e-6, "q8_0", [mx.array(k_pool)],
                              [mx.array(v_pool)], mx.array(np.array(pos, np.int32)), n_heads=HQ,
                              table=mx.array(table))


@pytest.mark.parametrize("on", [False, True])
def test_the_batch_forms_straight_v_loads_follow_their_option(on):
    """block_v_straight reaches the paged batch form's attention phase (VSTRAIGHT, read by
    decode_tiles.metal's paged LOAD_V_GROUP); the launch is otherwise the same (launches recorded)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_v_straight=on), recording() as rec:
        _paged_batch()
    (job,) = rec.jobs
    assert "_paged" in job.spec.name and job.constants["VSTRAIGHT"] is on and job.constants["M"] == 3


@pytest.mark.parametrize("on, slots", [(False, 1), (True, 1), (True, 0)])
def test_the_early_k_copy_follows_its_option_where_k_has_slots(on, slots):
    """block_k_early reaches the attention phase (KEARLY: decode_rows.metal's first round of K
    before the wait, the new row filled in) where K goes through slots; without slots it has
    nothing to copy early (launches recorded)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_k_early=on, block_k_slots=slots), recording() as rec:
        _token()
    (job,) = rec.jobs
    assert job.constants["KSLOTS"] == slots and job.constants["KEARLY"] is (on and slots > 0)


@pytest.mark.parametrize("early, head_norms, want", [
    (None, True, (2, True, 0)),    # auto with head norms (Qwen3's layer): two slots, both rounds early, no MMA
    (False, True, (1, False, 0)),  # off: the one slot of before
    (None, False, (1, False, 0)),  # auto without head norms: as before
])
def test_the_auto_early_copy_takes_two_slots_for_a_token_with_head_norms(early, head_norms, want):
    """block_k_early's auto form: a decode token's attention with head norms gets two K slots,
    both rounds copied before its wait and no MMA form; otherwise the slots of before (launches
    recorded)."""
    from kernels import options
    from kernels.runtime import recording

    stacks = _stacks()
    if head_norms:
        stacks.q_norm = stacks.k_norm = mx.ones((2, HD), mx.float32)
    with options.use(block_k_early=early), recording() as rec:
        _token(stacks)
    (job,) = rec.jobs
    assert (job.constants["KSLOTS"], job.constants["KEARLY"], job.constants["MMA"]) == want


def test_the_auto_early_copy_keeps_the_old_form_where_two_slots_do_not_fit(monkeypatch):
    """Where the launch's threadgroup memory holds one K slot but not two, a token with head norms
    keeps the form of before: one slot, not copied early (launches recorded)."""
    from kernels import attention
    from kernels.runtime import recording

    monkeypatch.setattr(attention, "slots_that_fit", lambda most, *args: min(most, 1))
    stacks = _stacks()
    stacks.q_norm = stacks.k_norm = mx.ones((2, HD), mx.float32)
    with recording() as rec:
        _token(stacks)
    (job,) = rec.jobs
    assert (job.constants["KSLOTS"], job.constants["KEARLY"]) == (1, False)


@pytest.mark.parametrize("on", [False, True, "auto"])
def test_the_batch_forms_o_codes_follow_their_option_and_stay_scratch(on):
    """block_o_codes: the batch form's attention writes the O phase's X' (O_CODES, three more
    outputs) where it is on or auto, and the caller gets the same arrays either way; a single token
    only where it is on (auto leaves it to stage its own; launches recorded)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_o_codes=on), recording() as rec:
        got = _paged_batch()
        one = _token()
    batch, single = rec.jobs
    batched, alone = bool(on), on is True
    assert ("_ocodes" in batch.spec.name) is batched and ("#define O_CODES 1\n" in batch.spec.prelude) is batched
    assert (batch.spec.outputs[-3:] == ("o_codes", "o_scales", "o_sums") if batched
            else "o_codes" not in batch.spec.outputs)
    assert len(got) == 3 and tuple(got[0].shape) == (3, D)
    assert ("_ocodes" in single.spec.name) is alone and f"#define O_CODES {int(alone)}\n" in single.spec.prelude
    assert single.spec.outputs[-3:] == ("o_codes", "o_scales", "o_sums") or not alone
    assert len(one) == 3


@pytest.mark.parametrize("on", [False, True])
def test_the_batch_forms_attention_prefetch_follows_its_option(on):
    """block_attn_ahead reaches the paged batch form (ATTN_AHEAD: its K and V blocks into the L2
    through the table before the wait), as it does the contiguous token (launches recorded)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_attn_ahead=on), recording() as rec:
        _paged_batch()
        _token()
    batch, single = rec.jobs
    assert "_paged" in batch.spec.name and batch.constants["ATTN_AHEAD"] is on and single.constants["ATTN_AHEAD"] is on


def _paged_batch_job(rows: int, batch: int, heads: tuple[int, int, int] = (16, 8, 128), **setting):
    """The recorded launch of a one-layer token_block's batch form at Qwen3-0.6B's widths: `batch`
    sequences over a paged pool whose table holds `rows` rows a sequence (the launch is sized for
    them), the positions on the device."""
    from kernels import options
    from kernels.runtime import recording

    hq, hkv, hd = heads
    d, f, bs = 1024, 3072, 16
    stacks = _one_layer(d, f, heads)
    width = -(-rows // bs)
    pool = mx.zeros((batch * width, hkv, hd // 8, bs, 8), mx.float16)
    v_pool = mx.zeros((batch * width, hkv, hd, bs), mx.float16)
    table = mx.array(np.arange(batch * width, dtype=np.int32).reshape(batch, width))
    with options.use(**setting), recording() as rec:
        blocks.token_block(mx.zeros((batch, d), mx.float16), stacks, 1e-6, "q8_0", [pool], [v_pool],
                           mx.array(np.full(batch, rows - 8, np.int32)), n_heads=hq, table=table)
    (job,) = rec.jobs
    return job


def test_the_batch_forms_split_partitions_count_every_sequences_heads():
    """The batch form's split attention sizes its partitions for about SPLIT_GRID tickets over all
    of its sequences' kv heads: 8 sequences of Qwen3-0.6B's 8 kv heads at 1040 rows, partitions of
    2 chunks (5 of them, 320 tickets), where counting one sequence's heads gave 9 of one (576
    tickets: 1.5 waves of its 384 threadgroups). One sequence keeps its layout (launches recorded)."""
    def layout(batch: int, **setting) -> tuple[int, int]:
        job = _paged_batch_job(1040, batch, **setting)
        dims = np.array(dict(zip(job.spec.inputs, job.inputs))["dims"])
        assert "_split" in job.spec.name
        return int(dims[2]), int(dims[3])

    assert layout(8) == (256, 5)
    assert layout(8, attn_partition=128) == (128, 9)
    assert layout(1) == (128, 9)


def test_the_batch_form_takes_wide_tickets_past_four_sequences():
    """block_batch_simds auto: token_block's batch form of 5 or more sequences whose context does
    not split runs threadgroups of 8 SIMD groups bound to 2 an SM (128 registers), each GEMV at its
    shape's R: Qwen3-0.6B's step of 8 has UP's 192 tickets of 4 rows a SIMD group and QKV's, O's and
    down's 256, 128 and 128 (block_narrow). 4 sequences, a context that may split, or the setting 0
    keep the shared geometry of 4; a setting other than 0, 4 or 8 is refused before any launch
    (launches recorded)."""
    def launch(rows: int, batch: int, **setting) -> tuple:
        job = _paged_batch_job(rows, batch, **setting)
        tickets = {name: int(np.array(a)[2]) for name, a in zip(job.spec.inputs, job.inputs)
                   if name in ("qkv_dims", "o_dims", "up_dims", "down_dims")}
        rows_a_simd = {kind: job.constants[f"R_{kind}"] for kind in ("QKV", "O", "UP", "DOWN")}
        return job.constants["NSIMD"], job.spec.launch_bounds, tickets, rows_a_simd

    wide = launch(200, 8)
    assert wide == (8, (256, 2), dict(qkv_dims=256, o_dims=128, up_dims=192, down_dims=128),
                    dict(QKV=2, O=1, UP=4, DOWN=1))
    assert launch(200, 5)[:2] == (8, (256, 2))
    for shared in (launch(200, 4), launch(1040, 8), launch(200, 8, block_batch_simds=0)):
        assert shared[:2] == (4, None), shared
    assert launch(200, 8, block_batch_simds=0)[2] == dict(qkv_dims=256, o_dims=256, up_dims=384, down_dims=256)
    assert launch(200, 4, block_batch_simds=8) == wide
    assert launch(200, 8, gemv_tuning="V3_R=2")[3]["UP"] == 2  # a sweep's R, where given
    with pytest.raises(ValueError, match="block_batch_simds must be 0, 4 or 8"):
        launch(200, 8, block_batch_simds=16)


def test_a_single_token_takes_wide_tickets_only_where_set():
    """block_batch_simds set to 8 gives a single token's launch threadgroups of 8 SIMD groups bound
    to 2 an SM (each staged X' serving twice the rows); auto and 0 keep the shared geometry's 4
    (launches recorded)."""
    def launch(**setting) -> tuple:
        job = _token_block_job(64, **setting)
        return job.constants["NSIMD"], job.spec.launch_bounds

    assert launch(block_batch_simds=8) == (8, (256, 2))
    assert launch()[0] == launch(block_batch_simds=0)[0] == 4


@pytest.mark.parametrize("on", [False, True])
def test_the_batch_forms_act_codes_follow_their_option_and_count_in_the_queue(on):
    """block_act_codes: the batch form's UP phase writes the DOWN phase's X' (ACT_CODES, three more
    outputs after block_o_codes' three) only where it is on, and so does a single token's (its only
    scratch outputs); the caller gets the same arrays either way; the blocks' counts sit after the
    queue's lines, in every queue (launches recorded)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(block_act_codes=on), recording() as rec:
        got = _paged_batch()
        one = _token()
    batch, single = rec.jobs
    assert ("_actcodes" in batch.spec.name) is on and ("#define ACT_CODES 1\n" in batch.spec.prelude) is on
    want = ("o_codes", "o_scales", "o_sums") + (("act_codes", "act_scales", "act_sums") if on else ())
    assert batch.spec.outputs[-len(want):] == want and len(got) == 3
    assert ("_actcodes" in single.spec.name) is on and (f"#define ACT_CODES {int(on)}\n" in single.spec.prelude)
    assert single.spec.outputs[-3:] == ("act_codes", "act_scales", "act_sums") or not on
    assert len(one) == 3
    assert blocks.queue_words(10) == 12 * blocks.QUEUE_STRIDE + blocks.BLOCK_COUNTS


@pytest.mark.parametrize("on", [False, True, None])
def test_rms_late_reaches_both_forms_and_its_scratch_is_counted(on):
    """block_rms_late: RMS_LATE in the constants of the batch form and of a single token (on in both
    by default: None); the scratch it widens (a float a SIMD group and row of X) is in each spec's
    count of threadgroup memory, as the front end measures the instantiated source (where libclang
    is installed)."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(**({} if on is None else {"block_rms_late": on})), recording() as rec:
        _paged_batch()
        _token()
    on = True if on is None else on
    assert [job.constants["RMS_LATE"] for job in rec.jobs] == [on, on]
    batch = rec.jobs[0]
    c = batch.constants
    widened = 4 * c["NSIMD"] * (c["M"] - 1) if on else 0
    assert batch.spec.threadgroup_bytes(c) == batch.spec.threadgroup_bytes({**c, "RMS_LATE": False}) + widened
    try:
        from harness.metal import front_end, launch_source, threadgroup_bytes_mismatch
        import clang.cindex  # noqa: F401
    except ImportError:
        return
    for job in rec.jobs:
        assert threadgroup_bytes_mismatch(job, front_end(launch_source(job))[1]) is None
