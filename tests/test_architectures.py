"""The architectures of harness/arch, end to end on the CPU: a random-weight file of each family
(and of llama's RoPE scalings and biases) written with the metadata llama.cpp's converter gives
it, loaded, and decoded by the reference variant (MLX built-ins) against the float64 oracle
(reference.model.forward) that reads the same description; the oracle's own new pieces against
their definitions; and the loader's refusal, in one line naming it, of every key and tensor it
does not run (nothing a file says is ignored)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from harness.program.arch import BIAS_PARTS
from harness.program.decode import ReferenceDecoder, generate
from harness.program.models import PRESETS, QTYPES, GGUFError, file_type_name, load_gguf, write_random_gguf
from kernels import options
from reference import rel_err
from reference.model import forward
from reference.rope import gelu, rope, rope_frequencies
from tests.decode_checks import decodes_as_float64, wraps_like_the_window

PROMPT, STEPS = 12, 40

# Each family's tiny preset, and llama's file-borne variants (the scalings llama.cpp reads, biases)
CONFIGS = {
    "qwen2": PRESETS["tiny-qwen2"],
    "gemma3": PRESETS["tiny-gemma3"],
    # a softcap that random weights' small scores feel (Gemma 2's real 50 barely moves them)
    "gemma2": replace(PRESETS["tiny-gemma2"], attn_softcap=1.0),
    "phi3": PRESETS["tiny-phi3"],
    "phi3-heads-96": replace(PRESETS["tiny-phi3"], n_heads=2, n_kv_heads=2, head_dim=96),  # Phi-3-mini's heads
    "llama-linear": replace(PRESETS["tiny-llama"], rope_scaling="linear", rope_factor=4.0),
    "llama-yarn": replace(PRESETS["tiny-llama"], rope_scaling="yarn", rope_factor=4.0, rope_orig_ctx=256),
    "llama-rope-freqs": replace(PRESETS["tiny-llama"], rope_freqs=True),
    "llama-biases": replace(PRESETS["tiny-llama"], biases=BIAS_PARTS),
    "llama-qkv-biases": replace(PRESETS["tiny-llama"], biases=("attn_q", "attn_k", "attn_v")),
    "gemma3-softcap": replace(PRESETS["tiny-gemma3"], final_softcap=50.0),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("arch")
    return {name: write_random_gguf(d / f"{name}.gguf", c, "q8_0", seed=3) for name, c in CONFIGS.items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_written_file_loads_as_its_config(files, name):
    """The loader reads back every feature the writer put in (keys and tensors), nothing more."""
    m = load_gguf(files[name])
    assert m.config.eps == pytest.approx(CONFIGS[name].eps, rel=1e-6)  # a float32 in the file
    assert replace(m.config, eps=CONFIGS[name].eps) == CONFIGS[name]
    assert file_type_name(m) == "q8_0"


@pytest.mark.parametrize("name", CONFIGS)
def test_reference_variant_against_float64(files, name):
    """The MLX reference variant against the float64 oracle, prompt then decode steps past the
    sliding window (tiny-gemma3's layer 0 sees 8 positions), greedy where the margin is clear."""
    m = load_gguf(files[name])
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    decodes_as_float64(ReferenceDecoder(m, PROMPT + STEPS), m, prompt, STEPS)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_sliding_layers_wrap_like_the_window(files, mode):
    """Gemma 3's sliding layer inside a cache that itself wraps around (20 rows, window 8). A fixed
    prompt: the cache's own window shows in the global layer alone, by more than the check's 1e-2
    for most prompts, not all (decode_checks' last assertion)."""
    m = load_gguf(files["gemma3"])
    prompt = np.random.default_rng(7).integers(0, m.config.vocab, PROMPT)
    wraps_like_the_window(ReferenceDecoder(m, 20), m, prompt, mode)


def test_modes_agree_on_a_sliding_window_model(files):
    from harness.program.decode import MODES

    m = load_gguf(files["gemma3"])
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    runs = {mode: generate(ReferenceDecoder(m, PROMPT + 24), prompt, 24, mode).generated for mode in MODES}
    assert len(set(map(tuple, runs.values()))) == 1, runs


def test_each_feature_changes_the_logits(files):
    """No feature is a no-op in the oracle: switching it off moves the logits (so the tests above,
    which compare two readers of the same description, could fail)."""
    tokens = np.arange(1, 30)
    for name, off in (("llama-linear", dict(rope_scaling="none", rope_factor=1.0)),
                      ("llama-yarn", dict(rope_scaling="none", rope_factor=1.0)),
                      ("llama-rope-freqs", dict(rope_freqs=False)),
                      ("gemma3", dict(sliding_window=0)),
                      ("gemma3-softcap", dict(final_softcap=0.0)),
                      ("gemma2", dict(attn_softcap=0.0)), ("gemma2", dict(sliding_window=0))):
        m = load_gguf(files[name])
        base = forward(m, tokens)[0]
        m.config = replace(m.config, **off)
        assert rel_err(forward(m, tokens)[0], base) > 1e-3, name
    m = load_gguf(files["llama-biases"])
    base = forward(m, tokens)[0]
    for part in BIAS_PARTS:
        m.tensors[f"blk.0.{part}.bias"] = np.zeros_like(m.tensors[f"blk.0.{part}.bias"])
    m.__dict__.pop("_float64")
    assert rel_err(forward(m, tokens)[0], base) > 1e-3


def test_rope_scalings_against_their_definitions():
    """Linear: positions divided by the factor; rope_freqs: each pair's angle divided by its
    factor; yarn: the ramp leaves the fastest pairs unscaled and scales the slowest by 1 / factor,
    with cos and sin times 1 + 0.1 ln(factor) (ggml's rope_yarn)."""
    d, theta = 64, 10000.0
    base = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles, mscale = rope_frequencies(d, theta, 0.25)
    np.testing.assert_allclose(angles, base / 4) and mscale == 1.0
    factors = np.geomspace(1, 8, d // 2)
    np.testing.assert_allclose(rope_frequencies(d, theta, 1.0, factors)[0], base / factors)
    yarn = dict(ext_factor=1.0, orig_ctx=256, beta_fast=32.0, beta_slow=1.0)
    angles, mscale = rope_frequencies(d, theta, 0.25, yarn=yarn)
    assert angles[0] == base[0] and angles[-1] == pytest.approx(base[-1] / 4)
    assert np.all(angles <= base) and mscale == pytest.approx(1 + 0.1 * np.log(4))
    x = np.random.default_rng(0).standard_normal((3, 2, d))  # rope with angles = rope at base
    np.testing.assert_allclose(rope(x, np.arange(3), theta, neox=True), rope(x, np.arange(3), neox=True, freqs=base))


def test_gelu_is_the_tanh_approximation():
    x = np.array([-3.0, -1.0, 0.0, 0.5, 2.0])
    np.testing.assert_allclose(gelu(x), [-0.0036373, -0.1588080, 0.0, 0.3457140, 1.9545977], rtol=3e-5)


# ---- the loader: every key and tensor used, or refused in one line naming it ------------------------
def _rewrite(src, dst, arch_keys=(), drop_keys=(), extra_tensors=(), arch=None):
    """A copy of a GGUF file with metadata keys added or dropped and tensors added."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = arch or bytes(reader.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.STRING:
            w.add_string(key, bytes(f.parts[f.data[0]]).decode())
        elif kind != gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.parts[f.data[0]].item(), kind)
    for key, value, kind in arch_keys:
        w.add_key_value(key, value, kind)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, data in extra_tensors:
        w.add_tensor(name, data)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def _refusals():
    from gguf import GGUFValueType as V

    f32 = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    return {
        # (file, keys, tensors) -> what the one line must name
        "rope_freqs in qwen2": ("qwen2", [], [("rope_freqs.weight", f32(32))], r"rope_freqs.weight \(RoPE frequency"),
        "longrope factors": ("phi3", [], [("rope_factors_long.weight", f32(32))], r"rope_factors_long.weight \(LongRoPE"),
        "moe router": ("llama-linear", [], [("blk.0.ffn_gate_inp.weight", f32(4, 256))],
                       r"blk.0.ffn_gate_inp.weight \(a mixture of experts' router\)"),
        "ffn bias": ("llama-biases", [], [("blk.1.ffn_down.bias", f32(256))], r"blk.1.ffn_down.bias \(an FFN bias\)"),
        "post norm in llama": ("llama-linear", [], [("blk.0.post_attention_norm.weight", f32(256))],
                               r"post_attention_norm.weight \(a post-attention norm\)"),
        "unknown tensor": ("qwen2", [], [("blk.0.attn_sinks.weight", f32(4))], r"blk.0.attn_sinks.weight \(a tensor"),
        "unknown key": ("llama-linear", [("llama.attention.clamp_kqv", 8.0, V.FLOAT32)], [],
                        r"metadata key llama.attention.clamp_kqv = 8.0"),
        "experts": ("qwen2", [("qwen2.expert_count", 8, V.UINT32)], [], r"qwen2.expert_count = 8"),
        "window in llama": ("llama-linear", [("llama.attention.sliding_window", 4096, V.UINT32)], [],
                            r"llama.attention.sliding_window = 4096 \(a sliding window; llama has none\)"),
        "attention softcap": ("gemma3", [("gemma3.attn_logit_softcapping", 50.0, V.FLOAT32)], [],
                              r"gemma3.attn_logit_softcapping = 50.0 \(a softcap of the attention scores\)"),
        "head norms in gemma2": ("gemma2", [], [("blk.0.attn_q_norm.weight", f32(64))], r"attn_q_norm.weight \(Q head norms\)"),
        "final softcap in qwen2": ("qwen2", [("qwen2.final_logit_softcapping", 30.0, V.FLOAT32)], [],
                                   r"qwen2.final_logit_softcapping \(a softcap"),
        "yarn beta": ("llama-yarn", [("llama.rope.scaling.yarn_beta_fast", 16.0, V.FLOAT32)], [],
                      r"yarn_beta_fast = 16.0 \(llama.cpp runs yarn with beta_fast 32"),
        "partial rotary": ("qwen2", [("qwen2.rope.dimension_count", 32, V.UINT32)], [],
                           r"qwen2.rope.dimension_count = 32 \(not the head size 64"),
        "scaling type": ("qwen2", [("qwen2.rope.scaling.type", "longrope", V.STRING),
                                   ("qwen2.rope.scaling.factor", 4.0, V.FLOAT32)], [],
                         r"rope.scaling.type = 'longrope' \(RoPE scaling"),
        "split file": ("gemma3", [("split.count", 2, V.UINT16)], [], r"metadata key split.count = 2"),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_what_a_file_says_is_used_or_refused_by_name(files, tmp_path, case):
    source, keys, tensors, named = _refusals()[case]
    path = _rewrite(files[source], tmp_path / "crafted.gguf", keys, extra_tensors=tensors)
    with pytest.raises(GGUFError, match=named) as err:
        load_gguf(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)) and "not supported" in message


def test_required_biases_and_read_but_not_applied_keys(files, tmp_path):
    """Qwen2's Q/K/V biases are required; Phi-3's sliding window is read and, as llama.cpp's phi3
    graph does, not applied (harness/program/arch/phi3.py); a yarn key equal to llama.cpp's is taken."""
    from gguf import GGUFValueType as V

    import gguf

    src = files["qwen2"]
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(tmp_path / "nobias.gguf"), "qwen2")
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and f.types[0] != V.ARRAY:
            if f.types[0] == V.STRING:
                w.add_string(key, bytes(f.parts[f.data[0]]).decode())
            else:
                w.add_key_value(key, f.parts[f.data[0]].item(), f.types[0])
    for t in reader.tensors:
        if not t.name.endswith(".bias"):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match=r"missing tensor\(s\) \['blk.0.attn_q.bias'"):
        load_gguf(tmp_path / "nobias.gguf")
    phi = _rewrite(files["phi3"], tmp_path / "phi.gguf", [("phi3.attention.sliding_window", 2047, V.UINT32)])
    assert load_gguf(phi).config.layer(0).window is None
    yarn = _rewrite(files["llama-yarn"], tmp_path / "yarn.gguf", [("llama.rope.scaling.yarn_beta_fast", 32.0, V.FLOAT32)])
    assert load_gguf(yarn).config.rope_scaling == "yarn"


def test_rows_name_the_files_types(files, tmp_path):
    """general.file_type's name where the file has one, else its matrices' type mix."""
    path = _rewrite(files["qwen2"], tmp_path / "untyped.gguf", drop_keys=("general.file_type",))
    assert file_type_name(load_gguf(path)) == "q8_0"
    path = write_random_gguf(tmp_path / "f16.gguf", "tiny-qwen3", "f16")
    assert file_type_name(load_gguf(path)) == "f16"


@pytest.mark.parametrize("name, variant, span, expected", [
    ("phi3", "megafused", "layer", "a fused attn_qkv matrix (in a launch a layer"),
    ("llama-biases", "fused", "token", "biases on attn_output"),
    ("qwen2", "megafused", "layer", "Q/K/V biases (in a launch a layer; mega_span=token"),
    # a launch a layer takes the llama / qwen3 layer alone; token_block takes these
    ("gemma3", "megafused", "layer", "post-attention and post-FFN norms (in a launch a layer; mega_span=token"),
    ("gemma2", "megafused", "layer", "an attention softcap of 1"), ("llama-yarn", "megafused", "layer", "yarn RoPE scaling"),
    ("llama-rope-freqs", "megafused", "layer", "rope_freqs.weight factors")])
def test_kernel_variants_name_what_they_do_not_run(files, name, variant, span, expected):
    """Before any launch (no GPU needed): a kernel variant lists the layer's features that no
    kernel of it maps yet, and sends the user to a variant that runs it."""
    from harness.program.kernel_decode import KernelDecoder

    m = load_gguf(files[name])
    with options.use(mega_span=span), pytest.raises(
            ValueError, match=r"variant does not run this .* model's .*the (reference|fused) variant does") as err:
        KernelDecoder(m, 64, variant)
    assert expected in str(err.value)
    assert ("the fused variant does (" in str(err.value)) == (variant == "megafused")


KERNEL_MAPPED = ["llama-linear", "llama-yarn", "llama-rope-freqs", "llama-qkv-biases", "qwen2", "phi3", "phi3-heads-96",
                 "gemma3", "gemma2", "gemma3-softcap"]
# what megafused's token_block runs too: RoPE tables, Gemma's layers and Qwen2's biases
# (kernels.blocks.LayerKind), Phi-3's fused tensors (the stacks' own concatenations)
MEGA_MAPPED = ["llama-linear", "llama-yarn", "llama-rope-freqs", "llama-qkv-biases", "qwen2", "phi3", "phi3-heads-96",
               "gemma3", "gemma2", "gemma3-softcap"]
VARIANT_FILES = [(v, n) for v in ("unfused", "fused") for n in KERNEL_MAPPED] + [("megafused", n) for n in MEGA_MAPPED]


@pytest.mark.parametrize("variant, name", VARIANT_FILES)
def test_kernel_plans_map_scalings_and_biases(files, name, variant):
    """On any machine (launches recorded, not run): the kernel variants build and replay their
    plan for these files; the biases are one add after the projection (megafused: in token_block's
    QKV phase), a scaled RoPE's table is
    the float64 oracle's layer 0 angles (yarn's factor squared into the attention scale), and
    Phi-3's fused tensors are read as the matrices the fused variant would make. megafused's
    token_block takes Gemma's layer whole: one launch and the last post-norm's."""
    from harness.program.kernel_decode import KernelDecoder
    from kernels.runtime import recording
    from reference.model import layer_rope

    m = load_gguf(files[name])
    with recording():
        decoder = KernelDecoder(m, 64, variant)
        decoder.forward(np.arange(5) % m.config.vocab)
        decoder.forward([1])
    biases = [s for s in decoder.plan if s.op == "bias"]
    if variant == "megafused":  # token_block's QKV phase adds them: no step of their own
        (block,) = [step for step in decoder.plan if step.op == "token_block"]
        assert not biases and ("+biases" in block.kernel) == bool(m.config.biases)
        assert (decoder.stacks.qkv_bias is not None) == bool(m.config.biases) == decoder.layer_kind.qkv_bias
        if m.config.biases:
            assert tuple(decoder.stacks.qkv_bias.shape) == (m.config.n_layers, decoder.nk["blk.0.attn_qkv.weight"][0])
    else:
        assert len(biases) == (m.config.n_layers if m.config.biases else 0)
    angles, mscale = layer_rope(m, 0)
    if name.startswith("llama-") and "biases" not in name:
        np.testing.assert_allclose(np.array(decoder.inv_freq), angles, rtol=1e-6)
    elif name.startswith("gemma3"):  # a table a layer: the sliding layers' base is not the global ones'
        for i in range(m.config.n_layers):
            np.testing.assert_allclose(np.array(decoder.inv_freqs[i]), layer_rope(m, i)[0], rtol=1e-6)
        assert decoder.windows == [m.config.layer(i).window or 0 for i in range(m.config.n_layers)] and any(decoder.windows)
        steps = " ".join(step.kernel for step in decoder.plan)
        assert "x sqrt(d_model), float32 stream" in steps and "GELU" in steps and "window 8" in steps
        if variant == "megafused":
            (block,) = [step for step in decoder.plan if step.op == "token_block"]
            assert block.launches == ("lathe_token_block", "lathe_post_norm_add")
            assert np.array(decoder.stacked_inv_freqs).shape == (m.config.n_layers, m.config.head_dim // 2)
        else:
            assert sum(step.op == "post_norm_add" for step in decoder.plan) == 2 * m.config.n_layers
        assert [step.op for step in decoder.plan].count("softcap") == (name == "gemma3-softcap")
    else:
        assert decoder.inv_freq is None
    assert decoder.scale == pytest.approx(m.config.scale * mscale ** 2)
    assert (mscale > 1) == (name == "llama-yarn")
    if name == "phi3":
        bound = " ".join(w for step in decoder.plan for w in step.weights)
        assert "blk.0.attn_qkv" in bound and "blk.0.ffn_gate_up" in bound and "attn_q.weight" not in bound


@pytest.mark.gpu
@pytest.mark.parametrize("variant, kv, name", [(v, kv, n) for v, kv in (("unfused", "contiguous"),
                                                                     ("fused", "contiguous"), ("fused", "paged"))
                                              for n in KERNEL_MAPPED] + [("megafused", "contiguous", n)
                                                                         for n in MEGA_MAPPED])
def test_kernel_variants_against_float64(files, name, variant, kv):
    """lathe's kernels on RoPE scalings, Q/K/V biases and Gemma's layers: a prompt, then decode
    tokens, against the float64 oracle (tests/decode_checks.py)."""
    from harness.program.kernel_decode import KernelDecoder

    m = load_gguf(files[name])
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    decodes_as_float64(KernelDecoder(m, PROMPT + STEPS, variant, kv), m, prompt, STEPS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-yarn", "qwen2"])
def test_kernel_variants_wrap_like_the_window(files, name):
    """The wrapping path (RoPE in launches of its own, then the cache writes) on a scaled RoPE and
    on biases: twice around a cache of 20 rows."""
    from harness.program.kernel_decode import KernelDecoder

    m = load_gguf(files[name])
    prompt = np.random.default_rng(7).integers(0, m.config.vocab, PROMPT)
    wraps_like_the_window(KernelDecoder(m, 20, "fused", overflow=True), m, prompt, "eager")


def test_kernel_variants_name_block_types_they_do_not_read(tmp_path):
    """A head size attention does not take, and a block type no GEMV reads (the 2- and 3-bit
    types), each named before any launch; the K mixes' fallbacks (Q5_0, Q8_0 beside Q4_K and Q6_K,
    as in Gemma-3-270M's Q4_K_M) and the IQ4s are read."""
    from harness.program.kernel_decode import KernelDecoder, kernel_gaps

    narrow = replace(PRESETS["tiny-llama"], d_model=160, n_heads=4, head_dim=40)
    m = load_gguf(write_random_gguf(tmp_path / "narrow.gguf", narrow, "q4_k_m"))
    assert {"Q5_0", "Q4_K", "Q6_K"} <= set(m.types.values())
    with pytest.raises(ValueError, match=r"heads of 40 \(attention takes [^;]*: the reference variant does"):
        KernelDecoder(m, 64, "unfused")
    types = {**m.types, "blk.0.attn_q.weight": "IQ4_NL", "blk.1.ffn_up.weight": "IQ4_XS"}
    assert not any("matrices" in gap for gap in kernel_gaps(narrow, types, "fused"))
    types.update({"blk.0.attn_k.weight": "Q2_K", "blk.1.ffn_down.weight": "IQ3_S"})
    assert "IQ3_S, Q2_K matrices (the GEMVs take Q4_0, Q8_0" in "; ".join(kernel_gaps(narrow, types, "fused"))


# Gemma-3-270M's Q4_K_M as llama.cpp's quantizer makes it, at a tiny size: 320-wide rows are not
# whole super-blocks, so attn_q/k/v and ffn_gate/up fall back to Q5_0 (attn_v to Q8_0 in the
# layers that take more bits) and the tied embedding to Q8_0, beside Q4_K attn_output and Q4_K /
# Q6_K ffn_down
GEMMA_K_MIX = replace(PRESETS["tiny-gemma3"], d_model=320, ff=512)


@pytest.mark.gpu
@pytest.mark.parametrize("variant, kv", [("unfused", "contiguous"), ("fused", "contiguous"), ("fused", "paged"),
                                        ("megafused", "contiguous")])
def test_gemma_k_mix_against_float64(tmp_path, variant, kv):
    """The real Gemma-3-270M file's block types, layer and sliding windows (layer 0 sees 8
    positions) on lathe's kernels: a prompt, then decode tokens, against the float64 oracle."""
    from harness.program.kernel_decode import KernelDecoder

    m = load_gguf(write_random_gguf(tmp_path / "gemma-k-mix.gguf", GEMMA_K_MIX, "q4_k_m", seed=4))
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= set(m.types.values())
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    decodes_as_float64(KernelDecoder(m, PROMPT + STEPS, variant, kv), m, prompt, STEPS)


def test_gemma_k_mix_plans_read_every_type(tmp_path):
    """On any machine (launches recorded): the fused plan of that mix runs each block type in our
    GEMVs (no MLX matmul at decode), Q|K in Q5_0 beside a Q8_0 V in one launch where the layer's
    types differ (a pair: each GEMV reads X' in its own chunks)."""
    from harness.program.kernel_decode import KernelDecoder
    from kernels.runtime import recording

    m = load_gguf(write_random_gguf(tmp_path / "gemma-k-mix.gguf", GEMMA_K_MIX, "q4_k_m", seed=4))
    with recording():
        decoder = KernelDecoder(m, 64, "fused")
        decoder.forward(np.arange(20) % m.config.vocab)
        decoder.forward([1])
    kernels = [step.kernel for step in decoder.plan]
    assert not any("mx.matmul" in k for k in kernels)
    assert any("Q5_0" in k for k in kernels) and any("Q8_0" in k for k in kernels)
    assert any("pair (Q5_0: q|k; Q8_0: v" in k for k in kernels)


BLOCK_TYPES = ["q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs"]  # every matrix of the file in that type


@pytest.mark.gpu
@pytest.mark.parametrize("variant, qtype", [(v, q) for v in ("unfused", "fused") for q in (*BLOCK_TYPES, "f16")]
                         + [("megafused", q) for q in BLOCK_TYPES])
def test_block_types_on_the_kernel_variants(tmp_path, qtype, variant):
    """A llama file whose every matrix (the embedding included) is a legacy or IQ4 block type, or
    F16 (the unquantized baseline: MLX's matmul in both variants): a prompt, then decode tokens,
    against the float64 oracle."""
    from harness.program.kernel_decode import KernelDecoder

    m = load_gguf(write_random_gguf(tmp_path / f"{qtype}.gguf", "tiny-llama", qtype, seed=5))
    assert set(m.types.values()) == {"F32", qtype.upper()}
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    decodes_as_float64(KernelDecoder(m, PROMPT + STEPS, variant), m, prompt, STEPS)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_block_type_files_plan_our_gemvs(tmp_path, qtype):
    """On any machine (launches recorded): fused and megafused run such a file on lathe's GEMVs
    and embedding."""
    from harness.program.kernel_decode import KernelDecoder
    from kernels.runtime import recording

    m = load_gguf(write_random_gguf(tmp_path / f"{qtype}.gguf", "tiny-llama", qtype, seed=5))
    with recording():
        decoder = KernelDecoder(m, 64, "fused")
        decoder.forward([1, 2, 3])
    assert not any("mx.matmul" in step.kernel for step in decoder.plan)
    assert any(qtype.upper() in step.kernel for step in decoder.plan if step.op == "embed")
    with recording():
        decoder = KernelDecoder(m, 64, "megafused")
        decoder.forward([1, 2, 3])
        decoder.forward([4])
    assert any(qtype.upper() in step.kernel for step in decoder.plan if step.op == "token_block")


def test_gemma2_takes_llama_cpps_defaults(files, tmp_path):
    """A Gemma 2 file silent on its window and softcaps gets llama.cpp's: 4096 tokens, 50 on the
    attention scores, 30 on the logits (llama-hparams.h, the gemma2 loader); the 27B's scale is
    1/sqrt(d_model / heads)."""
    path = _rewrite(files["gemma2"], tmp_path / "silent.gguf", drop_keys=(
        "gemma2.attention.sliding_window", "gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping"))
    c = load_gguf(path).config
    assert (c.sliding_window, c.attn_softcap, c.final_softcap) == (4096, 50.0, 30.0)
    assert [c.layer(i).window for i in range(c.n_layers)] == [4096, None]
    from harness.program.arch import architectures

    fields = dict(n_layers=46, d_model=4608, n_heads=32)
    assert architectures()["gemma2"].hparams(fields)["attn_scale"] == pytest.approx(144 ** -0.5)


def test_a_sliding_base_in_the_file_turns_the_sliding_layers(tmp_path):
    """`rope.freq_base_swa` is read for every family with sliding layers, as llama.cpp's loader
    reads it: Gemma 2's sliding layer 0 turns at the file's base, its global layer 1 at the
    global one, and the logits move with it."""
    c = replace(PRESETS["tiny-gemma2"], rope_theta_swa=1000.0)
    m = load_gguf(write_random_gguf(tmp_path / "swa-base.gguf", c, "q8_0", seed=3))
    assert (m.config.layer(0).theta, m.config.layer(1).theta) == (1000.0, 10000.0)
    tokens = np.arange(1, 30)
    base = forward(m, tokens)[0]
    m.config = replace(m.config, rope_theta_swa=0.0)
    assert rel_err(forward(m, tokens)[0], base) > 1e-3


def test_f16_files_run_fused(tmp_path):
    """On any machine (launches recorded): fused takes an F16 file, its QKV and gate+up joined as
    fp16 values for MLX's matmul, the norms, RoPE, attention and SwiGLU on lathe's kernels;
    megafused names F16 as a type its blocks do not take."""
    from harness.program.kernel_decode import KernelDecoder
    from kernels.runtime import recording

    m = load_gguf(write_random_gguf(tmp_path / "f16.gguf", "tiny-llama", "f16", seed=5))
    with recording():
        decoder = KernelDecoder(m, 64, "fused")
        decoder.forward([1, 2, 3])
        decoder.forward([4])
    assert decoder.nk["blk.0.attn_qkv.weight"] == ((4 + 2 * 2) * 64, 256)
    linears = [step for step in decoder.plan if step.op == "linear"]
    assert linears and all(step.kernel == "mx.matmul (F16)" for step in linears)
    assert any(step.op == "rope_attention" for step in decoder.plan)
    with pytest.raises(ValueError, match="its blocks take .*got F16"):
        KernelDecoder(m, 64, "megafused")


# Every family in every block type the writer makes (a tiny file each; the K mixes fall back as
# llama.cpp's quantizer does where rows are not whole super-blocks): Mistral is llama's graph.
FAMILY_FILES = {"llama": PRESETS["tiny-llama"], "qwen2": PRESETS["tiny-qwen2"], "qwen3": PRESETS["tiny-qwen3"],
                "gemma3": PRESETS["tiny-gemma3"], "gemma2": CONFIGS["gemma2"], "phi3": PRESETS["tiny-phi3"],
                # heads of 96, eight of them: O's rows of 768 hold whole 256-weight super-blocks
                "phi3-heads-96": replace(PRESETS["tiny-phi3"], n_heads=8, n_kv_heads=8, head_dim=96)}
FAMILY_TYPES = [(family, qtype) for family in FAMILY_FILES for qtype in QTYPES]


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("family-types")
    return {(f, q): write_random_gguf(d / f"{f}-{q}.gguf", FAMILY_FILES[f], q, seed=11) for f, q in FAMILY_TYPES}


@pytest.mark.parametrize("family, qtype", FAMILY_TYPES)
def test_every_family_in_every_block_type_against_float64(family_files, family, qtype):
    """The reference variant on a tiny file of each family in each block type, against the float64
    oracle on the same file's weights (CPU)."""
    m = load_gguf(family_files[family, qtype])
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    decodes_as_float64(ReferenceDecoder(m, PROMPT + STEPS), m, prompt, STEPS)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused"])
@pytest.mark.parametrize("family, qtype", FAMILY_TYPES)
def test_every_family_in_every_block_type_on_the_kernels(family_files, family, qtype, variant):
    """Each kernel variant on the same files, against float64; where a variant does not run a
    file (megafused: F16), it says so before any launch, naming the variant that does."""
    from harness.program.kernel_decode import KernelDecoder

    m = load_gguf(family_files[family, qtype])
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    try:
        decoder = KernelDecoder(m, PROMPT + STEPS, variant)
    except ValueError as err:
        assert variant == "megafused" and "F16" in str(err), err
        return
    decodes_as_float64(decoder, m, prompt, STEPS)


@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused"])
@pytest.mark.parametrize("family, qtype", FAMILY_TYPES)
def test_every_family_in_every_block_type_plans(family_files, family, qtype, variant):
    """On any machine (launches recorded): each kernel variant builds and replays its plan for
    each of those files, a prompt and a decode token, or refuses it by name before any launch
    (megafused: F16)."""
    from harness.program.kernel_decode import KernelDecoder
    from kernels.runtime import recording

    m = load_gguf(family_files[family, qtype])
    with recording() as rec:
        try:
            decoder = KernelDecoder(m, 64, variant)
        except ValueError as err:
            assert variant == "megafused" and "F16" in str(err), err
            assert not rec.jobs
            return
        decoder.forward(np.arange(5) % m.config.vocab)
        decoder.forward([1])
    assert rec.jobs
