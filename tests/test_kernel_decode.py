"""The decode loop's kernel variants (unfused, fused) against the float64 forward pass, as the
reference variant is tested: logits within 1e-2 over the decode steps after a 16-token prompt,
greedy tokens equal where the reference's top-2 margin is clear; modes give identical tokens."""

from __future__ import annotations

import numpy as np
import pytest

from harness.decode import MODES, generate
from harness.kernel_decode import KernelDecoder, kernel_plan
from harness.models import load_gguf, write_random_gguf
from reference import rel_err
from reference.model import forward

PROMPT, STEPS = 16, 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("kdecode")
    return {(p, q): load_gguf(write_random_gguf(d / f"{p}-{q}.gguf", p, q, seed=2))
            for p in ("tiny-llama", "tiny-qwen3") for q in ("f16", "q8_0", "q4_0")}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_fused_plan_has_fewer_steps(models, preset):
    c = models[preset, "q8_0"].config
    assert len(kernel_plan(c, True)) < len(kernel_plan(c, False))


def test_fused_needs_block_matrices(models):
    with pytest.raises(ValueError, match="one block type"):
        KernelDecoder(models["tiny-llama", "f16"], 32, "fused")
    with pytest.raises(ValueError, match="variant"):
        KernelDecoder(models["tiny-llama", "q8_0"], 32, "mlx")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_kernel_variant_against_float64(models, preset, qtype, variant):
    m = models[preset, qtype]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    decoder = KernelDecoder(m, PROMPT + STEPS, variant)
    ours = np.array(decoder.forward(prompt))[-1]
    want, cache = forward(m, prompt)
    want = want[-1]
    compared = 0
    for _ in range(STEPS):
        assert rel_err(ours, want) <= 1e-2
        top2 = np.sort(want)[-2:]
        if (top2[1] - top2[0]) > 1e-2 * abs(top2[1]):
            assert int(np.argmax(ours)) == int(np.argmax(want))
            compared += 1
        token = int(np.argmax(want))
        ours = np.array(decoder.forward([token]))[-1]
        step, cache = forward(m, [token], cache)
        want = step[-1]
    assert compared > STEPS // 2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_kernel_variant_modes_agree(models, variant):
    m = models["tiny-qwen3", "q4_0"]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    runs = {mode: generate(KernelDecoder(m, PROMPT + 12, variant), prompt, 12, mode).generated
            for mode in MODES}
    assert runs["step"] == runs["pipelined"] == runs["chained"] == runs["compiled"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unfused", "fused"])
def test_compiled_step_logits_match_the_eager_step(models, variant):
    """The compiled step (position on the device, attention over the whole cache's grid) gives
    the eager step's logits token after token, and writes the same caches."""
    import mlx.core as mx

    m = models["tiny-llama", "q8_0"]
    prompt = np.random.default_rng().integers(0, m.config.vocab, PROMPT)
    eager, compiled = KernelDecoder(m, 64, variant), KernelDecoder(m, 64, variant)
    eager.forward(prompt), compiled.forward(prompt)  # left lazy: compiled_step evaluates its inputs
    fn, n = compiled.compiled_step(), m.config.n_layers
    for token in np.random.default_rng().integers(0, m.config.vocab, 8):
        want = np.array(eager.forward([int(token)]))
        pos = mx.array([compiled.pos], dtype=mx.int32)
        logits, *caches = fn(mx.array([int(token)], dtype=mx.int32), pos, *compiled.k, *compiled.v)
        compiled.k, compiled.v, compiled.pos = caches[:n], caches[n:], compiled.pos + 1
        assert rel_err(np.array(logits), want) <= 1e-3
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(eager.k, compiled.k))
