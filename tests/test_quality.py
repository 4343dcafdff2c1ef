"""harness/quality.py: llama-perplexity's chunking and scoring, KL divergence and top-token
agreement against a reference, on the CPU with a tiny random-weight model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness import quality
from harness.program.decode import ReferenceDecoder
from harness.program.models import load_gguf, write_random_gguf
from reference.model import forward


def test_chunks_are_llama_perplexity_s():
    tokens = list(range(10, 10 + 2 * 8 + 5))  # two whole chunks of 8 and a tail that is dropped
    parts = quality.chunks(tokens, 8, bos=1)
    assert len(parts) == 2 and all(len(p) == 8 for p in parts)
    assert parts[0].tolist() == [1, *range(11, 18)] and parts[1].tolist() == [1, *range(19, 26)]
    assert len(quality.chunks(tokens, 8, bos=None, n_chunks=1)) == 1
    assert quality.chunks(tokens, 8, bos=None)[0][0] == 10  # no BOS where the tokenizer adds none
    with pytest.raises(ValueError, match="fewer than one chunk"):
        quality.chunks(tokens[:7], 8, bos=1)


def test_scores_against_the_float64_model(tmp_path):
    """The reference variant's perplexity equals exp(mean NLL) of the float64 forward pass over
    the second half of each chunk (within the MLX float32 path's error); a decoder against itself
    has KL 0 and agrees on every top token; another model's logits give KL > 0."""
    m = load_gguf(write_random_gguf(tmp_path / "m.gguf", "tiny-qwen3", "q8_0", seed=4))
    parts = quality.chunks(list(np.random.default_rng(1).integers(0, m.config.vocab, 64)), 32, bos=1)
    scores = quality.evaluate({"reference": ReferenceDecoder(m, 32), "again": ReferenceDecoder(m, 32)}, parts)
    nll, count = 0.0, 0
    for chunk in parts:
        logp = quality.log_softmax(forward(m, chunk)[0])
        nll -= sum(logp[i, chunk[i + 1]] for i in range(16, 31))
        count += 15
    assert scores["reference"].count == count == 30
    # mean NLL within 0.02 nats a token (the GPU's reference variant runs fp16 weights)
    assert math.log(scores["reference"].ppl) == pytest.approx(nll / count, abs=2e-2)
    assert scores["again"].kl == pytest.approx(0, abs=1e-9) and scores["again"].same_top == count
    assert scores["reference"].seconds > 0 and scores["again"].seconds > 0


def test_kl_and_top_agreement_by_their_definitions():
    rng = np.random.default_rng(2)
    ref, ours = rng.standard_normal((6, 50)), rng.standard_normal((6, 50))
    ref[0], ours[0] = 0.0, 0.0
    ref[0, 3] = ours[0, 3] = 5.0  # one position where both pick token 3
    p, q = quality.log_softmax(ref), quality.log_softmax(ours)
    s = quality.Scores()
    s.add(q, np.arange(6), p)
    want = [float(np.sum(np.exp(p[i]) * (p[i] - q[i]))) for i in range(6)]
    assert s.kl == pytest.approx(sum(want)) and s.kl_values == pytest.approx(want)
    assert want[0] == pytest.approx(0, abs=1e-12) and min(want[1:]) > 0
    assert s.same_top == int(np.sum(p.argmax(-1) == q.argmax(-1))) and s.same_top >= 1
    assert s.nll == pytest.approx(-sum(q[i, i] for i in range(6)))


def test_text_path_errors():
    with pytest.raises(ValueError, match="no such file"):
        quality.text_path("/no/such/text.txt")


def test_quality_rows_and_plot(tmp_path):
    """quality.csv's schema takes a run's rows (a variant's, llama.cpp's) and the plot draws them,
    also where only the reference ran."""
    from harness.plots import quality_plot
    from harness.results import append_rows, read_results

    common = dict(benchmark="quality", backend="cpu", device="cpu", model="m", qtype="q4_k_m", text="t.txt",
                  n_ctx=512, chunks=2, gbs=None, pct_peak=None, peak_gbs=None, bytes=1, mlx_version="x",
                  git_sha="abc", date="2026-11-26T00:00:00Z", us=1.0, tokens_scored=510)
    rows = [dict(common, kernel="lathe decode (reference)", variant="reference", ppl=41.7, ppl_err=1.4,
                 kl_mean=None, kl_p99=None, same_top=None),
            dict(common, kernel="llama-perplexity", variant="llama.cpp", ppl=41.73, ppl_err=1.37, kl_mean=None,
                 kl_p99=None, same_top=None, x_llama_cpp=1.0)]
    csv = append_rows(tmp_path / "quality.csv", "quality", rows)
    df = read_results(csv)
    assert list(df["variant"]) == ["reference", "llama.cpp"] and df["ppl"].tolist() == [41.7, 41.73]
    assert quality_plot(df, tmp_path / "quality.png", "t").stat().st_size > 1000
