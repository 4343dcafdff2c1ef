"""GGUF models on the CPU: the random-weight writer and the checked loader round-trip every
preset shape and type; bad files are clear errors; the float64 reference forward pass is
consistent between prefill and decode."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from harness.program.models import PRESETS, QTYPES, GGUFError, load_gguf, tensor_shapes, tensor_types, write_random_gguf
from reference.model import forward
from reference import formats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {(p, q): write_random_gguf(d / f"{p}-{q}.gguf", p, q, seed=1)
            for p in ("tiny-llama", "tiny-qwen3") for q in QTYPES}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_round_trip(tiny, preset, qtype):
    m = load_gguf(tiny[preset, qtype])
    c = PRESETS[preset]
    assert replace(m.config, eps=c.eps) == c and m.config.eps == pytest.approx(c.eps, rel=1e-6)
    assert set(m.tensors) == set(tensor_shapes(c))
    assert m.types == tensor_types(c, qtype) and m.types["output_norm.weight"] == "F32"
    kind = m.types["blk.1.attn_q.weight"]
    if qtype != "f16":  # blocks decode to finite weights of the expected size
        w = formats.dequantize(m.tensors["blk.1.attn_q.weight"], kind, c.d_model)
        assert w.shape == (c.n_heads * c.head_dim, c.d_model) and np.isfinite(w).all()
        assert 0.01 < w.std() < 0.2  # scaled by 1/sqrt(fan-in)


def test_k_mixes_are_llama_cpp_s():
    """q4_k_m / q5_k_m: attn_v and ffn_down Q6_K in the first and last eighth of the layers and
    every third layer between (llama.cpp's use_more_bits; for 32 layers 0-3, 6, 9, .., 27, 28-31),
    the output matrix Q6_K, all else the base type; q6_k all Q6_K; norms F32."""
    c = replace(PRESETS["tiny-llama"], n_layers=32)
    more = {0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31}
    for qtype, base in (("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K"), ("q6_k", "Q6_K")):
        types = tensor_types(c, qtype)
        for i in range(32):
            for name in ("attn_v", "ffn_down"):
                want = "Q6_K" if qtype == "q6_k" or i in more else base
                assert types[f"blk.{i}.{name}.weight"] == want, (qtype, i, name)
            for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
                assert types[f"blk.{i}.{name}.weight"] == base
            assert types[f"blk.{i}.attn_norm.weight"] == "F32"
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == base
    tied = tensor_types(replace(c, tied=True), "q4_k_m")
    assert tied["token_embd.weight"] == "Q6_K" and "output.weight" not in tied


def test_k_mixes_fall_back_where_rows_are_not_super_blocks(tmp_path):
    """llama.cpp's tensor_type_fallback: a matrix whose rows are not whole 256-weight super-blocks
    takes Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K (Gemma 3 270M's 640-wide rows); the file
    is written and read back with those types."""
    narrow = replace(PRESETS["tiny-llama"], d_model=160, n_heads=4, head_dim=40, n_layers=8)
    for qtype, low, high in (("q4_k_m", "Q5_0", "Q8_0"), ("q5_k_m", "Q5_1", "Q8_0")):
        types = tensor_types(narrow, qtype)
        assert types["blk.0.attn_q.weight"] == low and types["blk.0.attn_v.weight"] == high  # layer 0: more bits
        assert types["blk.0.ffn_down.weight"] == high.replace("Q8_0", "Q6_K")  # 512-wide rows: a K-quant
        assert types["output.weight"] == "Q8_0"
    m = load_gguf(write_random_gguf(tmp_path / "narrow.gguf", narrow, "q4_k_m"))
    assert m.types == tensor_types(narrow, "q4_k_m")


def test_kernels_take_k_quants_repacked_only(tiny):
    """The K-quants run on the v3 GEMVs, over weights repacked at load: without the repack
    option the kernel decoder says so, naming the types and the option, before it touches the
    device."""
    from harness.program.kernel_decode import KernelDecoder
    from kernels import options

    with options.use(repack=False), pytest.raises(ValueError, match="Q4_K, Q6_K matrices.*repack option"):
        KernelDecoder(load_gguf(tiny["tiny-llama", "q4_k_m"]), 16)


def test_same_seed_same_file(tmp_path):
    a = write_random_gguf(tmp_path / "a.gguf", "tiny-llama", "q4_0", seed=3).read_bytes()
    b = write_random_gguf(tmp_path / "b.gguf", "tiny-llama", "q4_0", seed=3).read_bytes()
    assert a == b


def test_bad_files_are_clear_errors(tmp_path, tiny):
    good = tiny["tiny-llama", "q8_0"].read_bytes()
    cases = {
        "truncated.gguf": (good[: len(good) // 2], "unreadable GGUF|missing"),
        "magic.gguf": (b"GGML" + good[4:], "wrong magic"),
        "empty.gguf": (b"", "wrong magic"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(GGUFError, match=message):
            load_gguf(tmp_path / name)
    with pytest.raises(GGUFError, match="no such file"):
        load_gguf(tmp_path / "absent.gguf")


def test_unsupported_architecture_and_missing_tensor(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        load_gguf(tmp_path / "gpt2.gguf")

    small = replace(PRESETS["tiny-llama"], n_layers=1)
    path = write_random_gguf(tmp_path / "one.gguf", small, "f16")
    data = load_gguf(path)
    assert data.config.n_layers == 1
    def rewrite(name, keys):
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        for key, value in keys:
            getattr(w, key)(value)
        for tensor, t in data.tensors.items():
            w.add_tensor(tensor, t)
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        return tmp_path / name

    keys = [("add_context_length", 64), ("add_embedding_length", small.d_model),
            ("add_feed_forward_length", small.ff), ("add_head_count", small.n_heads),
            ("add_layer_norm_rms_eps", 1e-5)]
    # Claims two layers but holds one: blk.1.* is missing.
    with pytest.raises(GGUFError, match=r"missing tensor\(s\) \['blk.1"):
        load_gguf(rewrite("short.gguf", keys + [("add_block_count", 2), ("add_head_count_kv", small.n_kv_heads)]))
    # Without a KV head count, K and V must be as wide as Q: these are misshapen.
    with pytest.raises(GGUFError, match=r"attn_k.weight is \(128, 256\), expected \(256, 256\)"):
        load_gguf(rewrite("no-kv.gguf", keys + [("add_block_count", 1)]))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_reference_prefill_then_decode_equals_one_pass(tiny, preset):
    m = load_gguf(tiny[preset, "q4_0"])
    tokens = np.random.default_rng(0).integers(0, m.config.vocab, 20)
    whole, _ = forward(m, tokens)
    assert np.isfinite(whole).all() and whole.shape == (20, m.config.vocab)
    logits, cache = forward(m, tokens[:16])
    steps = [logits[-1]]
    for t in tokens[16:]:
        step, cache = forward(m, [t], cache)
        steps.append(step[-1])
    np.testing.assert_allclose(np.stack(steps[1:]), whole[16:], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(logits, whole[:16], rtol=1e-9, atol=1e-9)
    assert cache.length == 20


def test_reference_rejects_bad_tokens(tiny):
    m = load_gguf(tiny["tiny-llama", "f16"])
    with pytest.raises(ValueError, match="token ids"):
        forward(m, [m.config.vocab])
    with pytest.raises(ValueError, match="non-empty"):
        forward(m, [])


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path, tiny):
    import gguf

    data = load_gguf(tiny["tiny-llama", "f16"])
    c = data.config
    w = gguf.GGUFWriter(str(tmp_path / "mxfp4.gguf"), "llama")
    for key, value in (("add_context_length", c.ctx), ("add_embedding_length", c.d_model),
                       ("add_block_count", c.n_layers), ("add_feed_forward_length", c.ff),
                       ("add_head_count", c.n_heads), ("add_head_count_kv", c.n_kv_heads),
                       ("add_layer_norm_rms_eps", c.eps)):
        getattr(w, key)(value)
    for name, t in data.tensors.items():
        if name == "blk.0.attn_q.weight":
            t = gguf.quants.quantize(t.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(name, t, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match=r"blk.0.attn_q.weight has type MXFP4; supported: .*Q4_0"):
        load_gguf(tmp_path / "mxfp4.gguf")


def test_the_writer_in_processes_writes_the_threads_bytes(tmp_path):
    """write_random_gguf(processes=n): the K mixes' tensors made in spawned processes (their
    quantizer holds the GIL) are the same bytes as in threads, each tensor from its own stream."""
    from harness.program.models import write_random_gguf

    threads = write_random_gguf(tmp_path / "threads.gguf", "tiny-llama", "q4_k_m")
    processes = write_random_gguf(tmp_path / "processes.gguf", "tiny-llama", "q4_k_m", processes=2)
    assert threads.read_bytes() == processes.read_bytes() and len(threads.read_bytes()) > 100_000
