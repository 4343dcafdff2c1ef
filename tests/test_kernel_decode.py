"""The decode loop's kernel variants (unfused, fused), over the contiguous and the paged KV
cache, against the float64 forward pass, as the reference variant is tested: logits within 1e-2
over the decode steps after a 16-token prompt, greedy tokens equal where the reference's top-2
margin is clear; modes give identical tokens."""

from __future__ import annotations

import numpy as np
import pytest

from harness.program.decode import MODES, generate
from harness.program.kernel_decode import BLOCK_SIZE, KernelDecoder, kernel_plan
from harness.program.models import load_gguf, write_random_gguf
from kernels import options
from reference import rel_err
from reference.model import forward
from tests.decode_checks import decodes_as_float64, wraps_like_the_window

PROMPT, STEPS = 16, 24
# llama.cpp's mixed files (Q6_K attn_v and ffn_down in some layers beside Q4_K / Q5_K) and a one-type one
K_MIXES = ("q4_k_m", "q5_k_m", "q6_k")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("kdecode")
    paths = {(p, q): write_random_gguf(d / f"{p}-{q}.gguf", p, q, seed=2)
             for p in ("tiny-llama", "tiny-qwen3") for q in ("f16", "q8_0", "q4_0", *K_MIXES)}
    return {key: load_gguf(path) for key, path in paths.items()} | {"_paths": paths}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_fused_plan_has_fewer_steps(models, preset):
    c = models[preset, "q8_0"].config
    assert len(kernel_plan(c, True)) < len(kernel_plan(c, False))


@pytest.mark.parametrize("inside", [True, False])
def test_fused_plan_shows_where_rope_runs(models, monkeypatch, inside):
    """Llama's decode RoPE + KV write: inside attention, or (option rope_in_attention=off) its
    own launch, rope_qkv_write with no norm weights; Qwen3 keeps its head-norm RoPE + KV write."""
    monkeypatch.setitem(options._values, "rope_in_attention", inside)
    llama = {s.op: s for s in kernel_plan(models["tiny-llama", "q8_0"].config, True) if s.layer == 0}
    if inside:
        assert "rope_attention" in llama and "rope_kv_write" not in llama and "attention" not in llama
    else:
        assert llama["rope_kv_write"].kernel == "lathe rope_qkv_write" and llama["rope_kv_write"].weights == ()
        assert "attention" in llama and "rope_attention" not in llama
    qwen = {s.op: s for s in kernel_plan(models["tiny-qwen3", "q8_0"].config, True) if s.layer == 0}
    assert qwen["rope_kv_write"].kernel == "lathe head_norm_rope_neox_qkv_write" and "rope_attention" not in qwen


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_seams_take_two_launches_a_layer(models, monkeypatch, preset):
    """With seams, a layer's output projection shares a launch with the gate+up RMSNorm+GEMV and
    its down GEMV with the next QKV (the last one's with the head): two launches a layer fewer;
    only where every paired matrix is in one block type, and not with the option seams=off."""
    from harness.program import kernel_decode

    m = models[preset, "q4_0"]
    c = m.config
    monkeypatch.setitem(options._values, "seams", True)
    assert kernel_decode.seams_apply(c, m.types)
    plain, seamed = kernel_plan(c, True), kernel_plan(c, True, seams=True)
    assert len(seamed) == len(plain) - 2 * c.n_layers
    assert [s.op for s in seamed if s.layer == c.n_layers - 1][-2:] == ["seam", "seam"]
    assert seamed[-1].writes == ("x", "logits") and "rmsnorm_linear" not in {s.op for s in seamed[2:]}
    assert kernel_plan(c, False, seams=True) == kernel_plan(c, False)  # unfused: no seams
    mixed = dict(m.types, **{"blk.0.ffn_down.weight": "Q8_0"})
    assert not kernel_decode.seams_apply(c, mixed)
    from kernels import backends  # on Metal a launch may not wait on another's threadgroups

    with monkeypatch.context() as metal:
        metal.setattr(backends.runtime, "target_backend", lambda: "metal")
        assert not kernel_decode.seams_apply(c, m.types)
    monkeypatch.setitem(options._values, "seams", False)
    assert not kernel_decode.seams_apply(c, m.types)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_paged_plan_writes_the_pool_then_reads_it(models, preset):
    """unfused: RoPE of q and of k, then reshape_and_cache; fused: RoPE and the write at the
    token's slot in one launch (rope_paged_kv_write), Qwen3's head norms in it too; attention
    after either."""
    c = models[preset, "q8_0"].config
    unfused = [s.op for s in kernel_plan(c, False, paged=True) if s.layer == 0]
    assert unfused.index("kv_write") < unfused.index("attention") and unfused.count("rope") == 2
    assert unfused.count("head_norm") == (2 if c.head_norm else 0)
    fused = [s for s in kernel_plan(c, True, paged=True) if s.layer == 0]
    ops = [s.op for s in fused]
    assert "rope" not in ops and "kv_write" not in ops and ops.index("rope_kv_write") < ops.index("attention")
    assert "head_norm" not in ops
    assert fused[ops.index("rope_kv_write")].launches == (
        ("lathe_head_norm_rope_kv_write_paged",) if c.head_norm else ("lathe_rope_kv_write_paged",))


def test_paged_cache_goes_through_the_block_table(models):
    """The decoder's slots scatter positions over the shuffled blocks: each position lands in
    the block the table names, at its offset, every slot once (CPU, no kernel)."""
    import mlx.core as mx

    m = models["tiny-llama", "q8_0"]
    decoder = KernelDecoder(m, 3 * BLOCK_SIZE + 5, "unfused", "paged")
    blocks = decoder.table.shape[1]
    assert blocks == 4 and sorted(decoder.table[0]) == list(range(blocks))
    assert list(decoder.table[0]) != list(range(blocks))  # scattered, not the identity
    assert all(np.isnan(np.array(a)).all() for a in (decoder.k[0], decoder.v[0]))  # all poison
    n = 3 * BLOCK_SIZE + 2
    slots = decoder._slots(0, n)
    assert len(set(slots.tolist())) == n and slots.max() < blocks * BLOCK_SIZE
    for p in (0, BLOCK_SIZE - 1, BLOCK_SIZE, n - 1):
        assert slots[p] == decoder.table[0, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    assert np.array_equal(decoder._slots(5, 3), slots[5:8])
    device_slot = decoder._slots(mx.array([n - 1], dtype=mx.int32), 1)
    assert np.array(device_slot).tolist() == [int(slots[-1])]
    with pytest.raises(ValueError, match="kv"):
        KernelDecoder(m, 32, "unfused", "ring")


def test_wrapping_is_asked_for(models):
    """A kernel decoder wraps around only when made with overflow=True (its decode steps then
    take the wrapping path); otherwise a full cache, and a prompt past it always, are clear
    errors before any launch; the paged cache does not wrap (CPU)."""
    m = models["tiny-llama", "q8_0"]
    with pytest.raises(ValueError, match="overflow=True"):
        KernelDecoder(m, 4, "fused").forward([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="prompts must fit"):
        KernelDecoder(m, 4, "fused", overflow=True).forward([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="paged"):
        KernelDecoder(m, 32, "fused", "paged", overflow=True)
    for fused in (False, True):
        ops = [s.op for s in kernel_plan(m.config, fused, overflow=True) if s.layer == 0]
        assert ops.count("rope") == 2 and ops.count("kv_write") == 2 and "rope_kv_write" not in ops
        assert ops.index("kv_write") < ops.index("attention")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_megafused_plan_is_one_launch_a_token(models, preset):
    """megafused (mega_span=token): a decode token is its embedding, one token_block launch over
    every layer where threadgroups may wait on each other (CUDA), each layer's phases as the
    fused variant's launches otherwise (Metal), then the head; the step names every layer's
    weights (CPU)."""
    c = models[preset, "q8_0"].config
    one = kernel_plan(c, True, packed=True, mega=True, one_launch=True, span="token")
    apart = kernel_plan(c, True, packed=True, mega=True, one_launch=False, span="token")
    assert [(s.layer, s.op) for s in one] == [(None, "embed"), (None, "token_block"), (None, "rmsnorm_linear_argmax")]
    assert one[1].launches == ("lathe_token_block",) and len(apart[1].launches) > 1
    last = c.n_layers - 1
    assert f"blk.{last}.ffn_down.weight" in one[1].weights and "blk.0.attn_qkv (q|k|v)" in one[1].weights
    assert ("blk.1.attn_q_norm.weight" in one[1].weights) == c.head_norm
    assert kernel_plan(c, True, packed=True, mega=True, phase="prompt", span="token") == kernel_plan(
        c, True, packed=True, phase="prompt")


@pytest.mark.parametrize("tokens", [2, 8, 11, 16])
def test_megafused_prompt_runs_token_blocks_of_rows(models, tokens):
    """A megafused prompt of up to mega_prompt_rows tokens: its plan is a decode token's with the
    head over the last row, and it launches token_block's prompt form, blocks.BATCH_ROWS rows a
    launch at their positions, over the stacked caches (launches recorded, CPU); past the option,
    fused's plan."""
    from kernels import blocks
    from kernels.runtime import recording

    m = models["tiny-qwen3", "q8_0"]
    c = m.config
    assert KernelDecoder(m, 64, "megafused").prompt_rows == options.get("mega_prompt_rows")
    with options.use(mega_prompt_rows=16):
        d = KernelDecoder(m, 64, "megafused")
    assert d.prompt_rows == 16
    plan = d.plan_for(tokens, last_only=True)
    assert [s.op for s in plan] == ["embed", "token_block", "last_row", "rmsnorm_linear_argmax"]
    assert "the prompt's rows" in plan[1].kernel
    with recording() as rec:
        d.forward(np.arange(3) % c.vocab)  # a prompt at depth 3
        rec.jobs.clear()
        d.forward(np.arange(tokens) % c.vocab, last_only=True)
    launched = [j for j in rec.jobs if "token_block" in j.spec.name]
    rows = [min(blocks.BATCH_ROWS, tokens - r0) for r0 in range(0, tokens, blocks.BATCH_ROWS)]
    assert [dict(zip(j.spec.inputs, j.inputs))["x_in"].shape[0] for j in launched] == rows
    at = [np.array(dict(zip(j.spec.inputs, j.inputs))["pos"]).tolist() for j in launched]
    assert sum(at, []) == list(range(3, 3 + tokens))
    assert all(n == 2 for n in [sum(i.startswith(("k_cache", "v_cache")) for i in j.spec.inputs) for j in launched])
    # each launch after the first takes the one before's stream rows (MLX orders launches by their arrays)
    after = [tuple(dict(zip(j.spec.inputs, j.inputs))["after"].shape) for j in launched]
    assert after == [(1,)] + [(r, c.d_model) for r in rows[:-1]]
    with options.use(mega_prompt_rows=tokens - 1):
        past = KernelDecoder(m, 64, "megafused")
    assert "token_block" not in [s.op for s in past.plan_for(tokens)]


def test_token_block_prompt_form_checks_its_rows(models):
    """token_block's prompt form takes 2..BATCH_ROWS rows at an int position whose rows fit the
    cache, and not Gemma's post-block norms: clear errors before any launch (CPU)."""
    import mlx.core as mx

    from kernels import blocks

    m = models["tiny-qwen3", "q8_0"]
    c = m.config
    d = KernelDecoder(m, 64, "megafused")
    k, v = d.k.whole(), d.v.whole()
    kw = dict(n_heads=c.n_heads, theta=c.rope_theta, neox=c.neox)
    x = mx.zeros((blocks.BATCH_ROWS + 1, c.d_model), mx.float16)
    qtype = d.stacks.w_qkv.qtypes[0]
    with pytest.raises(ValueError, match="1..8 rows"):
        blocks.token_block(x, d.stacks, c.eps, qtype, k, v, 0, **kw)
    with pytest.raises(ValueError, match="pos \\+ 4 <= 64"):
        blocks.token_block(x[:4], d.stacks, c.eps, qtype, k, v, 61, **kw)
    with pytest.raises(ValueError, match="int pos"):
        blocks.token_block(x[:4], d.stacks, c.eps, qtype, k, v, mx.array([0], mx.int32), **kw)


@pytest.mark.parametrize("stacked", [True, False])
def test_megafused_holds_each_caches_layers_in_one_array(models, stacked):
    """mega_kv_stacked: a megafused decoder keeps every layer's K in one array [layers, Hkv,
    max_seq, D] and its V in another. A prompt (fused's plan, a layer at a time) writes views of
    them, the stacks after it are ordered after those writes, and a decode token's token_block
    (so its compiled step) takes and returns 2 caches, not 2 x layers (launches recorded, CPU)."""
    import mlx.core as mx

    from harness.program.kernel_decode import StackedCaches
    from kernels.runtime import index, recording

    m = models["tiny-qwen3", "q8_0"]
    c = m.config
    with options.use(mega_kv_stacked=stacked, mega_prompt_rows=0):  # the prompt on fused's plan
        d = KernelDecoder(m, 64, "megafused")
    assert isinstance(d.k, StackedCaches) == stacked and len(d.cache_arrays()) == (2 if stacked else 2 * c.n_layers)
    before = d.cache_arrays()[0]
    with recording() as rec:
        d.forward(np.arange(PROMPT) % c.vocab)
        written = [j for j in rec.jobs if any(n.startswith("k_cache") for n in j.spec.inputs)]
        assert len(written) >= c.n_layers and all(
            tuple(dict(zip(j.spec.inputs, j.inputs))["k_cache"].shape[-3:]) == (c.n_kv_heads, 64, c.head_dim)
            for j in written)
        assert d.cache_arrays()[0] is not before  # the cache after the prompt's writes (the stack: ordered after)
        rec.jobs.clear()
        d.layers(mx.zeros((1,), mx.int32), 1, index(PROMPT))
    (token,) = [j for j in rec.jobs if "token_block" in j.spec.name]
    caches = [n for n in token.spec.inputs if n.startswith(("k_cache", "v_cache"))]
    assert len(caches) == (2 if stacked else 2 * c.n_layers) and ("_stacked" in token.spec.name) == stacked
    if stacked:
        assert tuple(d.cache_arrays()[0].shape) == (c.n_layers, c.n_kv_heads, 64, c.head_dim)


@pytest.mark.parametrize("variant", ["fused", "megafused"])
def test_head_argmax_gives_greedy_its_token(models, variant):
    """head_argmax: a one-row head on repacked weights (a decode token, a prompt's last row) is one
    launch that also gives the greedy token, and greedy() of those logits launches nothing more;
    greedy() of any other logits runs the argmax kernel. Off, or where Gemma 2's softcap changes
    the logits after the head, the head and the argmax launch apart (launches recorded, CPU)."""
    from dataclasses import replace

    import mlx.core as mx

    from harness.program.kernel_decode import head_argmax_applies
    from kernels.runtime import recording

    m = models["tiny-qwen3", "q8_0"]
    for on in (True, False):
        with options.use(head_argmax=on, seams=False), recording():
            d = KernelDecoder(m, 64, variant)
            assert d.head_fused(1) == on and d.head_fused(5, last_only=True) == on
            assert not d.head_fused(5)  # every row's logits: no one token
            with recording() as rec:
                logits = d.forward([1, 2, 3], last_only=True)
                token = d.greedy(logits)
                d.greedy(logits[:, :])  # logits of no head's launch
            names = [j.spec.name for j in rec.jobs]
            assert names.count("lathe_argmax") == (1 if on else 2)
            assert any(n.startswith("lathe_rmsnorm_gemv_v3_argmax") for n in names) == on
            assert token.shape == (1,) and token.dtype == mx.int32
    c = m.config
    assert head_argmax_applies(c, True, True, True, True)
    assert not head_argmax_applies(replace(c, final_softcap=30.0), True, True, True, True)
    assert not any(head_argmax_applies(c, *flags) for flags in
                   [(False, True, True, True), (True, False, True, True), (True, True, False, True),
                    (True, True, True, False)])



@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_megafused_plan_is_one_launch_a_layer(models, preset):
    """megafused: a decode token is layer 0's attention block, then a layer block for each layer
    (its FFN with the next layer's attention), the last layer's FFN block, the head: one launch
    each where threadgroups may wait on each other (CUDA), their phases as the fused variant's
    launches otherwise (Metal); Qwen3's head norms in the attention blocks; prompts and short
    steps keep fused's plan (CPU)."""
    c = models[preset, "q8_0"].config
    one = kernel_plan(c, True, packed=True, mega=True, one_launch=True, span="layer")
    apart = kernel_plan(c, True, packed=True, mega=True, one_launch=False, span="layer")
    ops = [(s.layer, s.op) for s in one]
    last = c.n_layers - 1
    assert ops == [(None, "embed"), (0, "attention_block"), *[(i, "layer_block") for i in range(last)],
                   (last, "ffn_block"), (None, "rmsnorm_linear_argmax")]
    assert [s.launches for s in one[1:-1]] == [("lathe_attention_block",)] + [("lathe_layer_block",)] * last + [
        ("lathe_ffn_block",)]
    assert [s.op for s in apart] == [s.op for s in one] and all(len(s.launches) > 1 for s in apart[1:-1])
    assert ("blk.1.attn_q_norm.weight" in one[2].weights) == c.head_norm and "blk.0.ffn_down.weight" in one[2].weights
    assert one[-1].writes == ("logits", "next_token")
    for phase in ("short", "prompt"):
        assert kernel_plan(c, True, packed=True, mega=True, phase=phase, span="layer") == kernel_plan(
            c, True, packed=True, phase=phase)
    assert kernel_plan(c, True, packed=False, mega=True, span="layer") == kernel_plan(c, True, packed=False)


def test_megafused_asks_for_what_it_runs_on(models, monkeypatch):
    """megafused takes the contiguous cache without overflow and repacked Q4_0/Q8_0 matrices:
    anything else is a clear error when the decoder is made (CPU)."""
    from kernels.runtime import recording

    m = models["tiny-llama", "q8_0"]
    for kv, overflow in (("paged", False), ("contiguous", True)):
        with pytest.raises(ValueError, match="megafused"):
            KernelDecoder(m, 32, "megafused", kv, overflow=overflow)
    monkeypatch.setitem(options._values, "repack", False)
    with pytest.raises(ValueError, match="repack"):
        KernelDecoder(m, 32, "megafused")
    with pytest.raises(ValueError, match="repack"):  # the K-quants run on repacked weights only
        KernelDecoder(models["tiny-llama", "q6_k"], 32, "fused")
    monkeypatch.setitem(options._values, "repack", True)
    with recording():
        # embed, token_block, the head with its argmax
        assert KernelDecoder(m, 64, "megafused").launches_per_token(40, device_pos=True) == 3
        with options.use(mega_span="layer"):
            decoder = KernelDecoder(m, 64, "megafused")
        assert decoder.launches_per_token(40, device_pos=True) == m.config.n_layers + 3


def test_megafused_takes_the_k_mixes(models):
    """llama.cpp's Q4_K_M / Q5_K_M: a layer's GEMVs of two block types (Q6_K attn_v and ffn_down
    in some layers). megafused keeps V's rows apart from [q; k] in every layer (one
    shape a layer for the stacks), and --show-plan says which matrices are of the other type. A
    mix that a launch cannot hold is refused by name (CPU)."""
    from harness.program.kernel_decode import mega_types, split_v_apart

    m = models["tiny-llama", "q4_k_m"]
    c, types = m.config, {n: t.lower() for n, t in m.types.items()}
    assert mega_types(c, types) is None and split_v_apart(c, types)
    assert not split_v_apart(c, {n: t.lower() for n, t in models["tiny-llama", "q6_k"].types.items()})
    v6 = sum(types[f"blk.{i}.attn_v.weight"] == "q6_k" for i in range(c.n_layers))
    down6 = sum(types[f"blk.{i}.ffn_down.weight"] == "q6_k" for i in range(c.n_layers))
    assert 0 < v6 < c.n_layers and 0 < down6 < c.n_layers  # the tiny preset really mixes
    plan = kernel_plan(c, True, types=types, packed=True, mega=True, span="token", one_launch=True)
    layers = c.n_layers
    assert f"(Q4_K; Q6_K: attn_v in {v6} of {layers} layers, ffn_down in {down6} of {layers} layers, repacked)" in \
        plan[1].kernel
    layer_plan = kernel_plan(c, True, types=types, packed=True, mega=True, span="layer", one_launch=True)
    assert all("Q4_K" in step.kernel for step in layer_plan[1:-1])
    # any quantized types share a launch (a Q8_0 GEMV reads X' in its own chunks)
    assert mega_types(c, {**types, "blk.0.ffn_down.weight": "q8_0"}) is None
    for why, change in (("its blocks take", {"blk.0.ffn_down.weight": "f16"}),
                        ("attn_q and attn_k", {"blk.1.attn_k.weight": "q6_k"})):
        assert why in mega_types(c, {**types, **change})


def test_fused_runs_a_mixed_projection_as_one_pair_launch(models):
    """Q4_K_M's layers whose attn_v is Q6_K: the fused decode token runs [q; k] and v as one
    launch (kernels.gemv's pair, mixed_projection=pair), as many steps as a file of one type;
    mixed_projection=concat, or GGUF blocks (no repack): a GEMV a type, then mx.concatenate (CPU)."""
    from harness.program.models import PRESETS, tensor_types

    c = PRESETS["llama3-8b"]
    types = {n: t.lower() for n, t in tensor_types(c, "q4_k_m").items()}
    mixed = sum(types[f"blk.{i}.attn_v.weight"] != types[f"blk.{i}.attn_q.weight"] for i in range(c.n_layers))
    one_type = kernel_plan(c, True, types={n: t.lower() for n, t in tensor_types(c, "q4_0").items()}, packed=True)
    pair = kernel_plan(c, True, types=types, packed=True)
    assert mixed == 16 and len(pair) == len(one_type)
    pairs = [s for s in pair if "pair" in s.kernel]
    assert len(pairs) == mixed and pairs[0].kernel == "lathe rmsnorm_gemv_v3 pair (Q4_K: q|k; Q6_K: v, repacked)"
    assert pairs[0].launches == ("lathe_rmsnorm_gemv_v3_pair",) and not any(s.op == "concat" for s in pair)
    with options.use(mixed_projection="concat"):
        concat = kernel_plan(c, True, types=types, packed=True)
    unpacked = kernel_plan(c, True, types=types, packed=False)
    for plan in (concat, unpacked):
        assert sum(s.op == "concat" for s in plan) == mixed and len(plan) == len(one_type) + 2 * mixed
        assert not any("pair" in s.kernel for s in plan)


def test_fused_needs_one_type_a_projection(models, tmp_path):
    """A fused projection's parts share a block type, or are all F16 (tests/test_architectures.py
    runs those); an F16 part beside quantized ones is refused; an unknown variant too."""
    m = load_gguf(write_random_gguf(tmp_path / "mixed.gguf", "tiny-llama", "q8_0"))
    from reference import formats

    up = "blk.0.ffn_up.weight"  # made F16 in this layer: its values, gate's Q8_0 blocks beside it
    m.tensors[up] = formats.dequantize(m.tensors[up], "Q8_0", m.config.d_model).astype(np.float16)
    m.types[up] = "F16"
    with pytest.raises(ValueError, match=r"one block type .*or F16\), got \['f16', 'q8_0'\]"):
        KernelDecoder(m, 32, "fused")
    with pytest.raises(ValueError, match="variant"):
        KernelDecoder(models["tiny-llama", "q8_0"], 32, "mlx")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", ["unfused", "fused", "fused without seams", "fused repacked",
                                     "fused repacked without seams", "unfused repacked", "megafused repacked",
                                     "megafused repacked layer-span", "megafused repacked prompt-form"])
def test_kernel_variant_against_float64(models, monkeypatch, preset, qtype, variant, kv):
    """Each variant's prompt and decode steps against the float64 model (prompt-form: megafused's
    prompt in token_block's prompt form, two launches of 8 rows)."""
    if variant.startswith("megafused") and kv == "paged":
        pytest.skip("megafused runs over the contiguous cache")
    monkeypatch.setitem(options._values, "mega_span", "layer" if "layer-span" in variant else "token")
    monkeypatch.setitem(options._values, "mega_prompt_rows", PROMPT if "prompt-form" in variant else 0)
    m = models[preset, qtype]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    seams = variant in ("fused", "fused repacked")
    monkeypatch.setitem(options._values, "seams", seams)
    monkeypatch.setitem(options._values, "repack", "repacked" in variant)
    decoder = KernelDecoder(m, PROMPT + STEPS, variant.split()[0], kv)
    assert decoder.seams == seams  # the decode steps take the path this case names
    assert bool(decoder.packed) == ("repacked" in variant)
    _decodes_as_float64(decoder, m, prompt)


def _decodes_as_float64(decoder, m, prompt) -> None:
    decodes_as_float64(decoder, m, prompt, STEPS)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("qtype", K_MIXES)
@pytest.mark.parametrize("variant", ["unfused", "fused", "fused concat", "megafused", "megafused prompt-form"])
def test_k_quant_files_against_float64(models, preset, qtype, variant, kv):
    """llama.cpp's K mixes (the v3 GEMVs on repacked K-quant matrices, Q4_K_M's mixed QKV as one
    launch of a pair of matrices, or with mixed_projection=concat one GEMV a block type, the
    embedding read from its K-quant rows); megafused with a block type a GEMV and a layer, V's
    rows apart where attn_v's type varies (prompt-form: its prompt in token_block's prompt form)."""
    if variant.startswith("megafused") and kv == "paged":
        pytest.skip("megafused runs over the contiguous cache")
    m = models[preset, qtype]
    with options.use(mixed_projection="concat" if variant.endswith("concat") else "pair",
                     mega_prompt_rows=PROMPT if "prompt-form" in variant else 0):
        decoder = KernelDecoder(m, PROMPT + STEPS, variant.split()[0], kv)
    assert {decoder.types[n] for n in decoder.packed} >= {"q6_k"}
    _decodes_as_float64(decoder, m, np.random.default_rng().integers(0, m.config.vocab, PROMPT))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_outputs", [True, False])
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused", "megafused layer-span"])
def test_kernel_variant_modes_agree(models, monkeypatch, variant, kv, cache_outputs):
    """Every mode's tokens the same; the compiled ones also where the compiled step returns no
    caches (decode_cache_outputs off)."""
    if variant.startswith("megafused") and kv == "paged":
        pytest.skip("megafused runs over the contiguous cache")
    monkeypatch.setitem(options._values, "mega_span", "layer" if "layer-span" in variant else "token")
    monkeypatch.setitem(options._values, "decode_cache_outputs", cache_outputs)
    for qtype in ("q4_0", "q4_k_m"):
        m = models["tiny-qwen3", qtype]
        prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
        runs = {mode: generate(KernelDecoder(m, PROMPT + 12, variant.split()[0], kv), prompt, 12, mode).generated
                for mode in MODES}
        assert runs["step"] == runs["pipelined"] == runs["chained"] == runs["compiled"], qtype


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fused", "megafused", "megafused layer-span"])
def test_head_argmax_decodes_the_argmax_launchs_tokens(models, monkeypatch, variant):
    """The head's launch with the argmax in it (head_argmax) gives, in every mode, the tokens that
    the head and then the argmax launch give: over the fused plan without seams (whose decode head
    is a one-row RMSNorm+GEMV) and megafused's, on a Q8_0 and a K mix's head."""
    monkeypatch.setitem(options._values, "mega_span", "layer" if "layer-span" in variant else "token")
    monkeypatch.setitem(options._values, "seams", False)
    for qtype in ("q8_0", "q4_k_m"):
        m = models["tiny-qwen3", qtype]
        prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
        runs = {}
        for on in (True, False):
            with options.use(head_argmax=on):
                for mode in MODES:
                    decoder = KernelDecoder(m, PROMPT + 12, variant.split()[0])
                    assert decoder.head_fused(1) == on
                    runs[on, mode] = generate(decoder, prompt, 12, mode).generated
        assert all(runs[True, mode] == runs[False, mode] for mode in MODES), qtype


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_a_resized_decoder_is_a_fresh_one(models, variant, kv):
    """resize() (one decoder over several depths): a cache grown, then shrunk, gives the tokens
    of a decoder made at that size, in the compiled modes too (traced again for the new size)."""
    m = models["tiny-qwen3", "q8_0"]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    resized = KernelDecoder(m, PROMPT + 12, variant, kv)
    for mode in ("compiled-pipelined", "step"):
        for rows in (PROMPT + 12 + 3 * BLOCK_SIZE + 5, PROMPT + 12):
            resized.resize(rows)
            want = generate(KernelDecoder(m, rows, variant, kv), prompt, 12, mode).generated
            assert generate(resized, prompt, 12, mode).generated == want, (mode, rows)
            assert resized.max_seq == rows and resized.k[0].shape == KernelDecoder(m, rows, variant, kv).k[0].shape


@pytest.mark.gpu
@pytest.mark.parametrize("cache_outputs", [True, False])
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused", "megafused layer-span"])
def test_compiled_step_logits_match_the_eager_step(models, monkeypatch, variant, kv, cache_outputs):
    """The compiled step (position on the device, attention over the whole cache's grid) gives
    the eager step's logits token after token, and writes the same caches. Each step's logits are
    read only after the next step was called from its host token, so that step must run the
    last one's cache writes first, also where the step returns no caches (decode_cache_outputs)."""
    import mlx.core as mx

    if variant.startswith("megafused") and kv == "paged":
        pytest.skip("megafused runs over the contiguous cache")
    monkeypatch.setitem(options._values, "mega_span", "layer" if "layer-span" in variant else "token")
    monkeypatch.setitem(options._values, "decode_cache_outputs", cache_outputs)
    variant = variant.split()[0]
    m = models["tiny-llama", "q8_0"]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    eager, compiled = KernelDecoder(m, 64, variant, kv), KernelDecoder(m, 64, variant, kv)
    eager.forward(prompt), compiled.forward(prompt)  # left lazy: compiled_step evaluates its inputs
    fn = compiled.compiled_step()

    def agrees(logits, want):
        assert rel_err(np.array(logits), want) <= 1e-3
        # greedy: our argmax kernel over the fp16 logits of the compiled step, as generate() reads them
        assert logits.dtype == mx.float16 and compiled.greedy(logits).tolist() == [int(np.argmax(np.array(logits)[-1]))]

    last = None
    for token in np.random.default_rng().integers(0, m.config.vocab, 8):
        want = np.array(eager.forward([int(token)]))
        pos = mx.array([compiled.pos], dtype=mx.int32)
        logits, *caches = fn(mx.array([int(token)], dtype=mx.int32), pos, *compiled.cache_arrays())
        compiled.take_caches(caches)
        compiled.pos += 1
        if last is not None:
            agrees(*last)
        last = logits, want
    agrees(*last)
    assert all(np.array_equal(np.array(a), np.array(b), equal_nan=True)  # paged: unwritten slots NaN
               for a, b in zip(eager.cache_arrays(), compiled.cache_arrays()))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused"])
@pytest.mark.parametrize("logits", ["all", "last"])
@pytest.mark.parametrize("cache_outputs", [True, False])
def test_compiled_prompt_matches_the_eager_prompt(models, variant, kv, logits, cache_outputs):
    """compiled_forward (the compiled modes' prompt, option prompt_compiled): a prompt at position
    0 and one that continues the cache give the eager forward's logits and caches, and a second
    prompt of the same length and position replays the traced function on its new inputs; also
    where it returns no caches (decode_cache_outputs off: the second prompt runs after the
    first's in-place writes, whose logits it evaluates first)."""
    if variant == "megafused" and kv == "paged":
        pytest.skip("megafused runs over the contiguous cache")
    m = models["tiny-qwen3", "q4_0"]
    rng = np.random.default_rng()
    with options.use(prompt_logits=logits, decode_cache_outputs=cache_outputs):
        eager, compiled = KernelDecoder(m, 64, variant, kv), KernelDecoder(m, 64, variant, kv)
        for attempt in range(2):
            eager.reset(), compiled.reset()
            for length in (PROMPT, 5):  # the second continues the first's cache
                prompt = rng.integers(0, m.config.vocab, length)
                want, got = np.array(eager.forward(prompt)), np.array(compiled.compiled_forward(prompt))
                assert got.shape == want.shape == (1 if logits == "last" else length, m.config.vocab)
                assert rel_err(got, want) <= 1e-3, (attempt, length)
            assert compiled.pos == eager.pos == PROMPT + 5
            assert all(np.array_equal(np.array(a), np.array(b), equal_nan=True)
                       for a, b in zip(eager.cache_arrays(), compiled.cache_arrays()))
            last = logits == "last"
            # traced once each
            assert sorted(compiled._compiled_prompts) == [(5, PROMPT, last, cache_outputs), (PROMPT, 0, last, cache_outputs)]


@pytest.mark.gpu
def test_compiled_prompt_checks_its_tokens_before_any_launch(models):
    m = models["tiny-qwen3", "q8_0"]
    decoder = KernelDecoder(m, 64, "fused")
    for bad in ([1, m.config.vocab], [-1, 2], [0.5, 1.0], []):
        with pytest.raises(ValueError, match="token|empty"):
            decoder.compiled_forward(bad)
    assert decoder.pos == 0 and not decoder._compiled_prompts


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused"])
@pytest.mark.parametrize("cache_outputs", [True, False])
def test_compiled_modes_decode_as_float64_after_a_compiled_prompt(models, monkeypatch, variant, kv, cache_outputs):
    """generate() in compiled-pipelined mode (its prompt through compiled_forward): each token
    the float64 model's greedy pick after the same tokens, wherever its top-2 margin is clear;
    with the compiled calls' caches returned or not (decode_cache_outputs)."""
    if variant == "megafused" and kv == "paged":
        pytest.skip("megafused runs over the contiguous cache")
    monkeypatch.setitem(options._values, "decode_cache_outputs", cache_outputs)
    m = models["tiny-llama", "q8_0"]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    decoder = KernelDecoder(m, PROMPT + STEPS, variant, kv)
    got = generate(decoder, prompt, STEPS, "compiled-pipelined").generated
    assert decoder._compiled_prompts, "the prompt did not take the compiled path"
    want, cache = forward(m, prompt)
    compared = 0
    for i, token in enumerate(got):  # the model fed our tokens: a near tie cannot derail the rest
        top2 = np.sort(want[-1])[-2:]
        if (top2[1] - top2[0]) > 1e-2 * abs(top2[1]):
            assert token == int(np.argmax(want[-1])), i
            compared += 1
        want, cache = forward(m, [token], cache)
    assert compared > STEPS // 2


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("variant", ["unfused", "fused"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_circular_overflow_against_float64(models, preset, variant, mode):
    """Twice around a cache of 20 rows, as the reference variant (tests/decode_checks.py)."""
    m = models[preset, "q4_0"]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    wraps_like_the_window(KernelDecoder(m, 20, variant, overflow=True), m, prompt, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_wrapping_modes_agree(models, variant):
    """Every mode gives the same tokens while wrapping around a cache of 20 rows."""
    m = models["tiny-qwen3", "q8_0"]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    runs = {mode: generate(KernelDecoder(m, 20, variant, overflow=True), prompt, 30, mode).generated
            for mode in MODES}
    assert len(set(map(tuple, runs.values()))) == 1, runs


PLAN_CASES = [(preset, "q8_0", variant, kv, overflow, rope_inside)
              for preset in ("tiny-llama", "tiny-qwen3")
              for variant in ("unfused", "fused", "fused without seams", "fused repacked",
                              "fused repacked without seams")
              for kv in ("contiguous", "paged") for overflow in (False, True) for rope_inside in (True, False)
              if not (overflow and kv == "paged") and (rope_inside or (variant != "unfused" and kv == "contiguous"))]
PLAN_CASES += [(preset, "q8_0", variant, "contiguous", False, True) for preset in ("tiny-llama", "tiny-qwen3")
               for variant in ("megafused repacked", "megafused repacked layer-span")]
# the K-quant files (repacked weights only): each variant once a cache layout, megafused where one type
PLAN_CASES += [(preset, qtype, variant, kv, False, True) for preset in ("tiny-llama", "tiny-qwen3")
               for qtype in K_MIXES for variant in ("unfused repacked", "fused repacked without seams")
               for kv in ("contiguous", "paged")]
PLAN_CASES += [(preset, "q4_0", "fused repacked without seams prologue-off", kv, False, True)  # qmm_norm_after
               for preset in ("tiny-llama", "tiny-qwen3") for kv in ("contiguous", "paged")]
PLAN_CASES += [(preset, "q6_k", "fused repacked", "contiguous", False, True)  # one type: seams
               for preset in ("tiny-llama", "tiny-qwen3")]
PLAN_CASES += [(preset, qtype, variant, "contiguous", False, True) for preset in ("tiny-llama", "tiny-qwen3")
               for qtype in K_MIXES for variant in ("megafused repacked", "megafused repacked layer-span")]
PLAN_CASES += [(preset, "q8_0", variant, "contiguous", False, True)  # a prompt's RoPE + K/V write in attention
               for preset in ("tiny-llama", "tiny-qwen3")
               for variant in ("fused rope-prefill", "fused repacked rope-prefill", "megafused repacked rope-prefill")]
PLAN_CASES += [(preset, "q4_0", variant, kv, False, True)  # prompts on fp16 copies (prompt_weights=f16)
               for preset in ("tiny-llama", "tiny-qwen3") for kv in ("contiguous", "paged")
               for variant in ("unfused f16-prompt", "fused repacked f16-prompt")]


@pytest.mark.parametrize("preset, qtype, variant, kv, overflow, rope_inside", PLAN_CASES)
def test_forward_launches_what_the_plan_says(models, monkeypatch, preset, qtype, variant, kv, overflow, rope_inside):
    """The plan is the program: forward() of a prompt of 20 tokens, of 3 and of one decode token
    replays its phase's plan step by step, each step launching only the kernels it names (at
    least one; none for an MLX op), and nothing launches outside a step. The decode plan is
    the one --show-plan prints. Launches are recorded (kernels.runtime.recording), so this runs
    on any machine: the kernels themselves do not run."""
    from dataclasses import replace

    from harness.program.decode import show_plan
    from harness.program.kernel_decode import phase_of
    from harness.program.plan import distinct_layers, plan_table
    from kernels.runtime import recording

    monkeypatch.setitem(options._values, "seams", variant in ("fused", "fused repacked"))
    monkeypatch.setitem(options._values, "rope_in_attention", rope_inside)
    monkeypatch.setitem(options._values, "repack", "repacked" in variant)
    monkeypatch.setitem(options._values, "mega_span", "layer" if "layer-span" in variant else "token")
    monkeypatch.setitem(options._values, "prompt_weights", "f16" if "f16-prompt" in variant else "dequantize")
    monkeypatch.setitem(options._values, "qmm_prologue", False if "prologue-off" in variant else "auto")
    monkeypatch.setitem(options._values, "rope_in_prefill", "rope-prefill" in variant)
    m = models[preset, qtype]
    with recording():  # the decoder's own look-ahead at its kernels, apart from what is checked
        decoder = KernelDecoder(m, 32 if overflow else 64, variant.split()[0], kv, overflow=overflow)
    for tokens in (20, 3, 1, 1):
        with recording():
            decoder.prepare_kernels((tokens,), decoder.pos)  # forward() would, inside the spans
        plan = decoder.plan_for(tokens)
        original, spans = list(plan), []  # (step, first launch, end) for each step that ran
        for n, step in enumerate(original):
            def run(d, env, t, pos, _n=n, _run=step.run):
                first = len(rec.jobs)
                _run(d, env, t, pos)
                spans.append((_n, first, len(rec.jobs)))
            plan[n] = replace(step, run=run)
        with recording() as rec:
            logits = decoder.forward(np.arange(tokens) % m.config.vocab)
        plan[:] = original
        assert logits.shape == (tokens, m.config.vocab)
        assert sum(end - first for _, first, end in spans) == len(rec.jobs), "a launch outside the plan's steps"
        for n, step in enumerate(plan):
            names = [job.spec.name for at, first, end in spans if at == n for job in rec.jobs[first:end]]
            assert bool(names) == bool(step.launches), (phase_of(tokens), n, step.op, names)
            assert all(name.startswith(step.launches) for name in names), (phase_of(tokens), n, step, names)
    assert decoder.plan is decoder.plan_for(1) and len(decoder.plan) == len(plan)
    if not overflow:  # --show-plan builds the same decode plan from the file alone
        path = models["_paths"][preset, qtype]
        assert show_plan(str(path), qtype, variant=variant.split()[0], kv=kv).endswith(
            plan_table(decoder.plan, distinct_layers(decoder.plan)))


@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused"])
@pytest.mark.parametrize("tokens", [3, 20])
@pytest.mark.parametrize("asked", ["option", "argument"])
def test_prompt_logits_last_runs_the_head_over_one_row(models, variant, tokens, asked):
    """prompt_logits=last, or forward(last_only=True) as generate() asks it: a prompt (short or
    long phase) gives its last token's logits only, the head a GEMV over that one row instead of
    a dequantized matrix over every row; a decode token's plan is the same either way (launches
    recorded, CPU); fused's and megafused's with the RMSNorm in the GEMV's launch."""
    from kernels.runtime import recording

    m = models["tiny-qwen3", "q8_0"]
    head = "token_embd.weight" if m.config.tied else "output.weight"
    jobs = {}
    for choice in ("all", "last"):
        by_option, last_only = (choice, None) if asked == "option" else ("all", choice == "last")
        with options.use(prompt_logits=by_option), recording():
            decoder = KernelDecoder(m, 64, variant)
            with recording() as rec:
                logits = decoder.forward(np.arange(tokens) % m.config.vocab, last_only=last_only)
            assert logits.shape == ((tokens if choice == "all" else 1), m.config.vocab)
            plan = decoder.plan_for(tokens, last_only)
            ops = [s.op for s in plan]
            assert ops.count("last_row") == (choice == "last") and plan[-1].weights[-1] == head
            if choice == "last":  # right before the head's RMSNorm (+ GEMV, one step where fused)
                assert ops[ops.index("last_row") + 1:] in (["rms_norm", "linear"], ["rmsnorm_linear"],
                                                           ["rmsnorm_linear_argmax"])
            assert "last_row" not in [s.op for s in decoder.plan_for(1)]
            jobs[choice] = [j.spec.name for j in rec.jobs]
    if tokens > 4:  # the long phase: the head's matmul (qmm, or dequantize + MLX's) gives way to a GEMV
        matmuls = {c: sum(name.startswith(("lathe_dequantize", "lathe_qmm")) for name in jobs[c]) for c in jobs}
        assert matmuls["all"] == matmuls["last"] + 1
        assert jobs["last"][-1].startswith(("lathe_gemv", "lathe_rmsnorm_gemv") if variant != "unfused" else "lathe_gemv")
    assert len(jobs["all"]) >= len(jobs["last"])


@pytest.mark.parametrize("variant", ["unfused", "fused repacked", "megafused repacked"])
@pytest.mark.parametrize("logits", ["all", "last"])
def test_prompt_weights_f16_copies_what_a_prompt_dequantized(models, monkeypatch, variant, logits):
    """prompt_weights=f16: the decoder makes, once, an fp16 copy of each matrix a prompt's matmuls
    read (the head only where the prompt's logits are all its rows'); a prompt then makes no
    dequantize launch, and the decode and short plans are the default's (launches recorded, CPU;
    the values: test_prompt_options_against_float64)."""
    import mlx.core as mx

    from kernels.runtime import recording

    monkeypatch.setitem(options._values, "repack", "repacked" in variant)
    m = models["tiny-qwen3", "q8_0"]
    head = "token_embd.weight" if m.config.tied else "output.weight"
    jobs, decoders = {}, {}
    for weights in ("dequantize", "f16"):
        with options.use(prompt_weights=weights, prompt_logits=logits), recording():
            decoders[weights] = decoder = KernelDecoder(m, 96, variant.split()[0])
            with recording() as rec:  # past qmm's rows: a prompt that dequantizes
                decoder.forward(np.arange(70) % m.config.vocab)
            jobs[weights] = [j.spec.name for j in rec.jobs]
    default, copies = decoders["dequantize"], decoders["f16"]
    assert default.f16 == {} and "lathe_dequantize" in jobs["dequantize"]
    assert "lathe_dequantize" not in jobs["f16"]
    matmuls = {w for s in default.plan_for(70) if "lathe_dequantize" in s.launches for w in s.weights
               if not (w == head and logits == "last")}
    assert set(copies.f16) == matmuls and (head in copies.f16) == (logits == "all")
    for name, w in copies.f16.items():
        assert w.dtype == mx.float16 and w.shape == copies.nk[name]
    for t in (1, 3):
        assert [s.kernel for s in copies.plan_for(t)] == [s.kernel for s in default.plan_for(t)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unfused", "fused", "fused repacked", "megafused repacked"])
@pytest.mark.parametrize("prompt_len", [3, PROMPT, 40])
@pytest.mark.parametrize("logits, weights", [("last", "dequantize"), ("all", "f16"), ("last", "f16")])
def test_prompt_options_against_float64(models, monkeypatch, variant, prompt_len, logits, weights):
    """prompt_logits=last (the last token's logits only) and prompt_weights=f16 (a prompt's
    matmuls on fp16 copies made at load): the logits and the decode after them as the float64
    model's, at a short and a long prompt."""
    monkeypatch.setitem(options._values, "repack", "repacked" in variant)
    m = models["tiny-llama", "q4_0"]
    with options.use(prompt_logits=logits, prompt_weights=weights):
        decoder = KernelDecoder(m, prompt_len + STEPS, variant.split()[0])
        _decodes_as_float64(decoder, m, np.random.default_rng().integers(0, m.config.vocab, prompt_len))


def test_launches_per_token_counts_every_kernel(models):
    """decode.csv's dispatches_per_token: the launches a decode token makes, recorded, the argmax
    included; past SPLIT_FROM cached rows a compiled step's attention (grid sized for the cache)
    launches its split and, with attn_combine=launch (auto's choice for the fused loop's RoPE
    launch), the combine: a layer's step makes two."""
    from kernels import attention
    from kernels.runtime import recording

    from dataclasses import replace

    m = models["tiny-llama", "q8_0"]
    deep = replace(m, config=replace(m.config, ctx=4096))  # room for a cache past SPLIT_FROM
    c = m.config
    with recording():
        short = KernelDecoder(m, 64, "fused")
        long = KernelDecoder(deep, attention.SPLIT_FROM + 64, "fused")
    argmax = 0 if short.head_fused(1) else 1  # a launch of its own unless the head's gives the token
    assert short.launches_per_token(40, device_pos=False) == len(short.plan) + argmax
    assert short.launches_per_token(40, device_pos=True) == len(short.plan) + argmax
    with options.use(attn_combine="launch"):
        assert long.launches_per_token(100, device_pos=True) == len(long.plan) + argmax + c.n_layers
        assert long.launches_per_token(100, device_pos=False) == len(long.plan) + argmax  # 101 tokens: whole
        assert long.launches_per_token(2100, device_pos=False) == len(long.plan) + argmax + c.n_layers
    with options.use(attn_combine="last_group"):
        assert long.launches_per_token(100, device_pos=True) == len(long.plan) + argmax
    # auto (the default): the fused loop's RoPE + attention launch keeps its combine launch
    assert long.launches_per_token(100, device_pos=True) == len(long.plan) + argmax + c.n_layers
    k_before = [id(k) for k in long.k]
    long.launches_per_token(100, device_pos=True)
    assert long.pos == 0 and [id(k) for k in long.k] == k_before  # the caches are the decoder's own


@pytest.mark.parametrize("variant, kv", [("unfused", "contiguous"), ("unfused", "paged"), ("fused", "contiguous"),
                                         ("fused", "paged"), ("megafused", "contiguous")])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_the_caches_are_checked_once_not_every_token(models, monkeypatch, preset, variant, kv):
    """Each cache a decoder writes in place (and the fused head's argmax scratch) is checked
    row-contiguous once (the buffer protocol, which evaluates it: a wait), at its first write; the
    caches each step passes on are known whole, so later tokens wait on nothing (launches
    recorded, CPU)."""
    from kernels import runtime

    evaluated = []
    monkeypatch.setattr(runtime, "memoryview", lambda a: evaluated.append(a.shape) or memoryview(a), raising=False)
    m = models[preset, "q8_0"]
    decoder = KernelDecoder(m, 64, variant, kv)
    with runtime.recording():
        decoder.layers(np.array([1]), 1, 0)
        first = len(evaluated)
        for pos in (1, 2, 3):
            decoder.layers(np.array([pos]), 1, pos)
    scratch = int(decoder.head_fused(1))
    assert 0 < first <= 2 * m.config.n_layers + scratch and len(evaluated) == first


@pytest.mark.parametrize("prologue, d_model, fused_norm", [
    (True, None, True), (False, None, False),
    ("auto", None, True), ("auto", 4096, False)])  # auto: in the prologue below d_model 4096
def test_qmm_prologue_option_picks_the_prompts_norm_launches(models, prologue, d_model, fused_norm):
    """A prompt of 5..64 rows (the gemm phase, fused, repacked): RMSNorm as qmm's prologue (QKV
    and gate+up), or with qmm_prologue off lathe's rmsnorm first and qmm on its output, the gated
    epilogue kept either way; auto by d_model. The plan only, no kernel."""
    import dataclasses

    from harness.program.kernel_decode import QMM_PROLOGUE_BELOW_D
    from kernels import options

    c = models["tiny-llama", "q8_0"].config
    assert c.d_model < QMM_PROLOGUE_BELOW_D
    if d_model:
        c = dataclasses.replace(c, d_model=d_model)
    with options.use(qmm_prologue=prologue, qmm_norm_after=False):  # (the norms folded: the test below)
        steps = [s for s in kernel_plan(c, True, phase="gemm", packed=True) if s.layer == 0]
    ops = [s.op for s in steps]
    if fused_norm:
        assert ops.count("rmsnorm_linear") == 1 and "rmsnorm_linear_swiglu" in ops and "rms_norm" not in ops
    else:
        assert ops.count("rms_norm") == 2 and "linear_swiglu" in ops and "rmsnorm_linear" not in ops
        assert steps[ops.index("linear_swiglu")].launches == ("lathe_qmm_",)


@pytest.mark.parametrize("prologue, after", [(False, True), (False, False), (True, True)])
def test_qmm_norm_after_writes_the_layers_norms_in_qmms_adding_launch(models, prologue, after):
    """qmm_norm_after with qmm_prologue off (the gemm phase): O's and down's qmm + residual write
    the RMSNorm that follows (ffn_norm; the next layer's attn_norm), so only layer 0's attn_norm
    and the output norm stay rmsnorm launches; each folded step writes h, which the next
    projection reads. Off, or with the prologue, nothing is folded. The plan only, no kernel."""
    c = models["tiny-llama", "q4_0"].config
    types = {f"blk.{i}.{p}.weight": "q4_0" for i in range(c.n_layers)
             for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    with options.use(qmm_prologue=prologue, qmm_norm_after=after):
        steps = kernel_plan(c, True, phase="gemm", packed=True, types=types)
    ops = [s.op for s in steps]
    folded = [s for s in steps if s.op == "linear_residual_rmsnorm"]
    if prologue or not after:
        assert not folded and ops.count("rms_norm") == (1 if prologue else 2 * c.n_layers + 1)
        return
    assert len(folded) == 2 * c.n_layers - 1 and ops.count("rms_norm") == 2
    assert [s.layer for s in steps if s.op == "rms_norm"] == [0, None]  # layer 0's attn_norm, the output norm
    for s in folded:
        assert s.writes == ("x", "h") and s.launches == ("lathe_qmm_split", "lathe_qmm_reduce_residual_norm")
        after_it = steps[steps.index(s) + 1]
        assert after_it.reads == ("h",) and s.weights[1] in (f"blk.{s.layer}.ffn_norm.weight",
                                                             f"blk.{s.layer + 1}.attn_norm.weight")


@pytest.mark.parametrize("preset, qtype", [("tiny-llama", "q4_0"), ("tiny-qwen3", "q8_0")])
def test_qmm_rows8_gives_qmm_the_row_blocks_copy(models, monkeypatch, preset, qtype):
    """Option qmm_rows8: the decoder keeps a RowBlocks copy of each repacked Q4_0 / Q8_0 matrix
    (a tied head's too), and a 20-token prompt's qmm launches read it (ROWS8 1); off, none is made
    and they read the v3 copy. Launches recorded (CPU)."""
    from kernels import gemv
    from kernels.runtime import recording

    monkeypatch.setitem(options._values, "repack", True)
    m = models[preset, qtype]
    for on in (True, False):
        monkeypatch.setitem(options._values, "qmm_rows8", on)
        with recording():
            decoder = KernelDecoder(m, 64, "fused")
        assert bool(decoder.rows8) == on
        assert all(isinstance(w, gemv.RowBlocks) and decoder.packed[name].n == w.n for name, w in decoder.rows8.items())
        with recording() as rec:
            decoder.forward(np.arange(20) % m.config.vocab)
        qmm = [j for j in rec.jobs if j.spec.name.startswith("lathe_qmm") and "reduce" not in j.spec.name]
        assert qmm and all(j.constants["ROWS8"] == int(on) for j in qmm)


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("preset, qtype", [("tiny-llama", "q4_0"), ("tiny-qwen3", "q8_0")])
def test_qmm_rows8_decodes_the_same_bits(models, monkeypatch, preset, qtype, mma):
    """RowBlocks only move W's bytes: a 20-token prompt's logits and the next tokens' are the same
    bits with option qmm_rows8 on as off (qmm's sums, and qmm_mma's where qmm hands it the launch,
    in the same order), and decode as float64."""
    import mlx.core as mx

    if not __import__("kernels.runtime", fromlist=["has_gpu"]).has_gpu():
        pytest.skip("no GPU backend")
    if mma and not __import__("kernels.native", fromlist=["available"]).available():
        pytest.skip("no native kernels (qmm_mma)")
    monkeypatch.setitem(options._values, "repack", True)
    # both copies' launches on one kernel: qmm's, or qmm_mma's where it takes them (the tiny models'
    # matrices are under auto's bound)
    monkeypatch.setitem(options._values, "qmm_mma", mma)
    m = models[preset, qtype]
    prompt = np.random.default_rng().integers(0, m.config.vocab, 20)
    logits = {}
    for on in (True, False):
        monkeypatch.setitem(options._values, "qmm_rows8", on)
        decoder = KernelDecoder(m, 64, "fused")
        logits[on] = np.array(decoder.forward(prompt).astype(mx.float32))
    assert np.array_equal(logits[True], logits[False])
    monkeypatch.setitem(options._values, "qmm_rows8", True)
    _decodes_as_float64(KernelDecoder(m, PROMPT + STEPS, "fused"), m, prompt[:PROMPT])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("phase", ["short", "gemm", "prompt"])
def test_prompt_plan_folds_rope_into_attention(models, monkeypatch, preset, phase):
    """rope_in_prefill on: a fused prompt's RoPE (Qwen3: and head norms) + KV write is a step with
    its attention (one launch where wgmma takes it, else its two); off (the default): the two
    steps as before. A decode token's plan is the same either way."""
    c = models[preset, "q8_0"].config
    layer = lambda: [s.op for s in kernel_plan(c, True, phase=phase) if s.layer == 0]  # noqa: E731
    decode = [s.op for s in kernel_plan(c, True) if s.layer == 0]
    apart = layer()
    assert "rope_prefill_attention" not in apart and apart.index("rope_kv_write") < apart.index("attention")
    monkeypatch.setitem(options._values, "rope_in_prefill", True)
    folded = layer()
    assert "rope_prefill_attention" in folded and "rope_kv_write" not in folded and "attention" not in folded
    assert [s.op for s in kernel_plan(c, True) if s.layer == 0] == decode
