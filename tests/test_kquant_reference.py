"""reference/kquant.py: Q4_K, Q5_K and Q6_K. Dequantized values equal to the gguf package's own
dequantizer on random and adversarial bytes; quantized bytes equal to GGML's reference quantizer
(ggml-quants.c, built by tests/ggml_reference.py) on random, adversarial and tail-shaped weights;
clear errors for what the formats cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants

from reference import kquant
from reference import quant as q32
from tests import ggml_reference

GGUF_TYPE = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
QTYPES = kquant.QTYPES


def weights(kind: str, rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Rows that stress the searches: heavy tails, one sign, zeros, sparse, constant, scales at
    the fp16 edges, ties on the rounding grid."""
    make = {
        "gauss": lambda: rng.standard_normal((n, k)),
        "heavy": lambda: rng.standard_t(2, (n, k)),
        "positive": lambda: np.abs(rng.standard_normal((n, k))),
        "negative": lambda: -np.abs(rng.standard_normal((n, k))),
        "zeros": lambda: np.zeros((n, k)),
        "sparse": lambda: rng.standard_normal((n, k)) * (rng.random((n, k)) < 0.05),
        "constant": lambda: np.full((n, k), 0.37),
        "tiny": lambda: rng.standard_normal((n, k)) * 1e-20,
        "huge": lambda: rng.standard_normal((n, k)) * 3e4,
        "grid": lambda: np.round(rng.standard_normal((n, k)) * 8) / 16,
        "one_outlier": lambda: np.where(np.arange(k) % 256 == 17, 50.0, rng.standard_normal((n, k)) * 0.01),
    }
    return make[kind]().astype(np.float32)


KINDS = ["gauss", "heavy", "positive", "negative", "zeros", "sparse", "constant", "tiny", "huge", "grid",
         "one_outlier"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_block_sizes_are_ggml_s(qtype):
    assert GGML_QUANT_SIZES[GGUF_TYPE[qtype]] == (kquant.QK_K, kquant.BLOCK_BYTES[qtype])
    assert kquant.storage_bytes(qtype, 3, 768) == 3 * 3 * kquant.BLOCK_BYTES[qtype]


@pytest.mark.parametrize("k", [256, 768, 4352])
@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf_on_random_bytes(qtype, k):
    """Any bytes, NaN and inf scales included: the same float32 values (NaN where gguf's are)."""
    rng = np.random.default_rng(k)
    data = rng.integers(0, 256, (5, k // 256 * kquant.BLOCK_BYTES[qtype]), dtype=np.uint8)
    data[0] = 0xFF  # every scale and quant at its largest (fp16 NaN scales)
    data[1] = 0
    with np.errstate(invalid="ignore", over="ignore"):
        got = kquant.dequantize(data, qtype, k)
        want = quants.dequantize(data, GGUF_TYPE[qtype]).reshape(5, k)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("k", [256, 4352])
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_repacked_layout_decodes_to_the_same_weights(qtype, k):
    """reference.kquant.pack (the v3 GEMV's load-time layout) read back from its own definition
    gives dequantize's values for any bytes, and keeps the byte count; every level and high bit
    survives (levels of the packed bytes, read the layout's way, equal levels of the blocks)."""
    rng = np.random.default_rng(k + 1)
    data = rng.integers(0, 256, (3, k // 256 * kquant.BLOCK_BYTES[qtype]), dtype=np.uint8)
    data[1] = 0xFF
    packed = kquant.pack(data, qtype, 3, k)
    assert packed.size == data.size
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(kquant.dequantize_packed(packed, qtype, 3, k), kquant.dequantize(data, qtype, k))
    with pytest.raises(ValueError, match="takes"):
        kquant.dequantize_packed(packed[:-1], qtype, 3, k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_equals_ggml_reference(qtype, kind):
    """The bytes of GGML's quantize_row_<type>_ref, on rows of 1, 3 and 17 super-blocks."""
    try:
        ggml_reference.library()
    except Exception as exc:  # noqa: BLE001 - no compiler, no sources: say so
        pytest.skip(f"GGML's reference quantizer could not be built here: {exc}")
    rng = np.random.default_rng(len(kind))
    for k in (256, 768, 4352):
        w = weights(kind, rng, 6, k)
        got = kquant.quantize(w, qtype)
        want = ggml_reference.quantize(w, qtype, got.shape[1])
        differ = np.argwhere(got != want)
        assert not len(differ), f"{len(differ)} of {got.size} bytes differ at K={k}, first {differ[:4].tolist()}"


@pytest.mark.parametrize("qtype", QTYPES)
def test_round_trip_within_the_format(qtype):
    """Gaussian weights come back closer the more bits a weight has, and every K-quant closer than
    Q4_0 (4.5 bits a weight, like Q4_K); gguf reads our bytes as we do."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((32, 1024)).astype(np.float32)
    data = kquant.quantize(w, qtype)
    back = kquant.dequantize(data, qtype, 1024)
    np.testing.assert_array_equal(back, quants.dequantize(data, GGUF_TYPE[qtype]).reshape(32, 1024))
    rmse = float(np.sqrt(np.mean((back - w) ** 2)))
    q4_0 = float(np.sqrt(np.mean((q32.dequantize(q32.quantize(w, "q4_0"), "q4_0", 1024) - w) ** 2)))
    bound = {"q4_k": 0.075, "q5_k": 0.038, "q6_k": 0.019}[qtype]  # 4.5, 5.5 and 6.6 bits a weight
    assert rmse < bound and rmse < q4_0, (rmse, q4_0)


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_rows_stay_zero(qtype):
    data = kquant.quantize(np.zeros((2, 512), np.float32), qtype)
    assert not kquant.dequantize(data, qtype, 512).any()


@pytest.mark.parametrize("bad, message", [
    (lambda: kquant.quantize(np.zeros((2, 300), np.float32), "q4_k"), "multiple of 256"),
    (lambda: kquant.quantize(np.zeros((2, 128), np.float32), "q6_k"), "multiple of 256"),
    (lambda: kquant.quantize(np.full((1, 256), np.nan, np.float32), "q5_k"), "NaN or inf"),
    (lambda: kquant.quantize(np.zeros(256, np.float32), "q4_k"), r"\[n, k\]"),
    (lambda: kquant.quantize(np.zeros((1, 256), np.float32), "q3_k"), "qtype must be one of"),
    (lambda: kquant.dequantize(np.zeros((1, 100), np.uint8), "q4_k", 256), r"\[n, 144\] bytes"),
])
def test_bad_input_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()
