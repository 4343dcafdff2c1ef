"""reference/quant.py: Q4_0 and Q8_0 blocks byte for byte equal to the gguf package's own
quantizer, on random and adversarial data, and the round trip within the format's resolution."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from reference.quant import BLOCK_BYTES, dequantize, gguf_rows, quantize, storage_bytes

GGUF_TYPE = {"q4_0": T.Q4_0, "q8_0": T.Q8_0}


def adversarial(rng: np.random.Generator) -> np.ndarray:
    """Rows of 32-blocks that stress the rules: zeros, ties, extremes, signs, fp16 edges."""
    blocks = [
        np.zeros(32),
        np.full(32, 65504.0),  # fp16 max
        np.full(32, -65504.0),
        np.linspace(-1, 1, 32),
        np.r_[np.full(31, 0.5), -0.5],  # equal magnitudes: the first one wins
        np.r_[-3.0, np.full(31, 3.0)],
        np.r_[1e-7, np.zeros(31)],  # a scale that underflows in fp16
        np.arange(32) * 0.25 - 4.0,  # exact half steps: rounding ties
        np.full(32, 6.1e-5),  # fp16 subnormal neighbourhood
        rng.standard_normal(32) * 1e4,
    ]
    return np.stack([np.concatenate(blocks)] * 3).astype(np.float32) * np.array([[1], [-1], [0.5]])


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("source", ["normal", "uniform", "fp16", "adversarial"])
def test_bytes_equal_to_gguf(qtype, source):
    rng = np.random.default_rng()
    w = {
        "normal": lambda: rng.standard_normal((7, 96)).astype(np.float32),
        "uniform": lambda: rng.uniform(-3, 3, (5, 4128)).astype(np.float32),
        "fp16": lambda: rng.standard_normal((9, 256)).astype(np.float16),
        "adversarial": lambda: adversarial(rng),
    }[source]()
    ours = quantize(w, qtype)
    theirs = quants.quantize(w.astype(np.float32), GGUF_TYPE[qtype])
    assert ours.dtype == np.uint8 and ours.shape == (w.shape[0], storage_bytes(qtype, 1, w.shape[1]))
    np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))
    np.testing.assert_array_equal(dequantize(ours, qtype, w.shape[1]),
                                  quants.dequantize(theirs, GGUF_TYPE[qtype]).reshape(w.shape))


@pytest.mark.parametrize("qtype, steps", [("q4_0", 8), ("q8_0", 127)])
def test_round_trip_within_half_a_step(qtype, steps):
    w = np.random.default_rng().standard_normal((4, 320)).astype(np.float32)
    back = dequantize(quantize(w, qtype), qtype, 320)
    blocks, err = w.reshape(-1, 32), np.abs(back - w).reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / steps
    # Half a step, plus the scale's fp16 rounding (relative 2^-11) times the largest |q|, plus one
    # step for Q4_0, whose value opposite the extreme clips at q = 15 (7 steps instead of 8).
    bound = step * (0.5 + steps * 2.0**-11) + (step if qtype == "q4_0" else 0)
    assert np.all(err <= bound * (1 + 1e-6))


def test_storage_and_block_sizes():
    assert BLOCK_BYTES == {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}
    assert storage_bytes("q4_0", 4096, 4096) == 4096 * 128 * 18
    assert storage_bytes("q8_0", 1, 32) == 34


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: quantize(np.zeros((2, 33)), "q4_0"), "multiple of 32"),
        (lambda: quantize(np.zeros(32), "q8_0"), r"\[n, k\]"),
        (lambda: quantize(np.zeros((1, 32)), "q2_0"), "qtype"),
        (lambda: quantize(np.full((1, 32), np.nan), "q8_0"), "NaN"),
        (lambda: dequantize(np.zeros((2, 17), np.uint8), "q4_0", 32), "bytes"),
        (lambda: gguf_rows(np.zeros(8), (2, 2, 2)), "2-D"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_gguf_layout_to_rows():
    k, n = 64, 3
    w = np.arange(n * k, dtype=np.float32).reshape(n, k)
    np.testing.assert_array_equal(gguf_rows(w.reshape(-1), (k, n)), w)
    q = quantize(w, "q8_0")
    np.testing.assert_array_equal(gguf_rows(q.reshape(-1), (k, n)), q)
