"""reference/quant.py's Q4_1, Q5_0, Q5_1 and reference/iquant.py's IQ4_NL, IQ4_XS (and their
dispatch in reference/formats.py). Dequantized values equal to the gguf package's own dequantizer
on random and adversarial bytes; quantized bytes equal to GGML's reference quantizer (ggml-quants.c,
built by tests/ggml_reference.py) on random, adversarial and tail-shaped weights, and for the
32-weight formats to gguf's quantizer; sizes equal to gguf's; clear errors for what the formats
cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants

from reference import formats, iquant, quant
from tests import ggml_reference
from tests.test_kquant_reference import KINDS, weights
from tests.test_quant_reference import adversarial

LEGACY = ("q4_1", "q5_0", "q5_1")
QTYPES = (*LEGACY, *iquant.QTYPES)
MODULE = {**{q: quant for q in LEGACY}, **{q: iquant for q in iquant.QTYPES}}
BLOCK = {**{q: quant.BLOCK for q in LEGACY}, **iquant.BLOCK_WEIGHTS}
SIZES = {q: MODULE[q].BLOCK_BYTES[q] for q in QTYPES}
# rows of 1, 3 and an odd number of blocks (the 32-weight formats: 37, so no row is a multiple of 64)
WIDTHS = {q: (32, 96, 1184) if BLOCK[q] == 32 else (256, 768, 4352) for q in QTYPES}


def ggml_library():
    try:
        return ggml_reference.library()
    except Exception as exc:  # noqa: BLE001 - no compiler, no sources: say so
        pytest.skip(f"GGML's reference quantizer could not be built here: {exc}")


@pytest.mark.parametrize("qtype", QTYPES)
def test_sizes_are_ggml_s(qtype):
    assert GGML_QUANT_SIZES[T[qtype.upper()]] == (BLOCK[qtype], SIZES[qtype])
    k = 3 * BLOCK[qtype]
    assert MODULE[qtype].storage_bytes(qtype, 5, k) == 5 * 3 * SIZES[qtype]
    assert formats.row_bytes(qtype.upper(), k) == 3 * SIZES[qtype]
    assert formats.block_weights(qtype.upper()) == BLOCK[qtype]
    assert qtype.upper() in formats.GGUF_BLOCK_TYPES


def _scale_offsets(qtype: str) -> tuple[int, ...]:
    """Byte offsets in a block of its fp16 scales (d, and m for Q4_1/Q5_1)."""
    return (0, 2) if qtype in ("q4_1", "q5_1") else (0,)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf_on_random_and_adversarial_bytes(qtype):
    """Any bytes: every byte 0xFF (NaN scales, the top level and sub-scale), zeros, and random
    blocks whose fp16 scales are set to inf, -inf, -0, the largest finite and the smallest
    subnormal: the same float32 values, NaN where gguf's are."""
    rng = np.random.default_rng(len(qtype))
    specials = np.array([0x7C00, 0xFC00, 0x8000, 0x7BFF, 0x0001, 0x3C00], np.uint16).view(np.uint8).reshape(-1, 2)
    for k in WIDTHS[qtype]:
        blocks = k // BLOCK[qtype]
        data = rng.integers(0, 256, (8, blocks * SIZES[qtype]), dtype=np.uint8)
        data[0], data[1] = 0xFF, 0
        view = data[2:].reshape(6, blocks, SIZES[qtype])
        for at in _scale_offsets(qtype):
            view[..., at:at + 2] = specials[rng.integers(0, len(specials), (6, blocks))]
        with np.errstate(invalid="ignore", over="ignore"):
            got = MODULE[qtype].dequantize(data, qtype, k)
            want = quants.dequantize(data, T[qtype.upper()]).reshape(8, k)
            via = formats.dequantize(data, qtype.upper(), k)
        assert got.dtype == np.float32 and got.shape == (8, k)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(via, got)


def _weights(kind: str, rng: np.random.Generator, qtype: str, k: int) -> np.ndarray:
    if kind == "adversarial":  # tests/test_quant_reference's 32-blocks, tiled to the width
        rows = adversarial(rng)
        return np.tile(rows, (1, -(-k // rows.shape[1])))[:, :k]
    return weights(kind, rng, 6, k)


@pytest.mark.parametrize("kind", [*KINDS, "adversarial"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_equals_ggml_reference(qtype, kind):
    """The bytes of GGML's quantize_row_<type>_ref. The one exception is IQ4_NL's blocks whose
    largest |x| is under 1e-15: GGML writes d = 0 and leaves the index bytes as its buffer held
    (undefined); ours are 0x88, and only their scale is compared."""
    ggml_library()
    rng = np.random.default_rng(len(kind) + len(qtype))
    for k in WIDTHS[qtype]:
        w = _weights(kind, rng, qtype, k)
        got = MODULE[qtype].quantize(w, qtype)
        want = ggml_reference.quantize(w, qtype, got.shape[1])
        assert got.dtype == np.uint8 and got.shape == (w.shape[0], MODULE[qtype].storage_bytes(qtype, 1, k))
        np.testing.assert_array_equal(formats.quantize(w, qtype.upper()), got)
        if qtype == "iq4_nl":
            empty = np.abs(w.reshape(-1, 32)).max(axis=1) < 1e-15
            got_b, want_b = got.reshape(-1, SIZES[qtype]), want.reshape(-1, SIZES[qtype]).copy()
            assert np.all(got_b[empty, 2:] == 0x88) and not got_b[empty, :2].any()
            want_b[empty, 2:] = 0x88
            want = want_b.reshape(want.shape)
        differ = np.argwhere(got != want)
        assert not len(differ), f"{len(differ)} of {got.size} bytes differ at K={k}, first {differ[:4].tolist()}"


@pytest.mark.parametrize("kind", [*KINDS, "adversarial"])
@pytest.mark.parametrize("qtype", LEGACY)
def test_quantize_equals_gguf(qtype, kind):
    """gguf's quantizer gives the same bytes, once -0 is +0: on a block's ties between -0 and +0
    (its min, max or signed extreme) gguf's NumPy reductions may pick the other zero than GGML's
    first-wins loops, which we follow (an fp16 d or m of 0x8000 against 0x0000)."""
    rng = np.random.default_rng(len(kind))
    for k in WIDTHS[qtype]:
        w = _weights(kind, rng, qtype, k) + np.float32(0)  # -0 + 0 = +0
        got = quant.quantize(w, qtype)
        with np.errstate(over="ignore"):
            want = quants.quantize(w, T[qtype.upper()]).reshape(got.shape)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype, bound", [("q4_1", 0.082), ("q5_0", 0.045), ("q5_1", 0.040),
                                          ("iq4_nl", 0.082), ("iq4_xs", 0.080)])
def test_round_trip_within_the_format(qtype, bound):
    """Gaussian weights come back closer than Q4_0's (4.5 bits a weight), the 5-bit formats about
    twice as close; zeros stay zeros."""
    w = np.random.default_rng(7).standard_normal((32, 1024)).astype(np.float32)
    back = MODULE[qtype].dequantize(MODULE[qtype].quantize(w, qtype), qtype, 1024)
    rmse = float(np.sqrt(np.mean((back - w) ** 2)))
    q4_0 = float(np.sqrt(np.mean((quant.dequantize(quant.quantize(w, "q4_0"), "q4_0", 1024) - w) ** 2)))
    assert rmse < bound and rmse < q4_0, (rmse, q4_0)
    zeros = MODULE[qtype].quantize(np.zeros((2, 512), np.float32), qtype)
    assert not MODULE[qtype].dequantize(zeros, qtype, 512).any()


@pytest.mark.parametrize("bad, message", [
    (lambda: quant.quantize(np.zeros((2, 48), np.float32), "q4_1"), "multiple of 32"),
    (lambda: quant.quantize(np.zeros((2, 16), np.float32), "q5_1"), "multiple of 32"),
    (lambda: quant.dequantize(np.zeros((1, 22), np.uint8), "q5_0", 40), "multiple of 32"),
    (lambda: iquant.quantize(np.zeros((2, 48), np.float32), "iq4_nl"), "multiple of 32"),
    (lambda: iquant.quantize(np.zeros((2, 288), np.float32), "iq4_xs"), "multiple of 256"),
    (lambda: iquant.dequantize(np.zeros((1, 136), np.uint8), "iq4_xs", 128), "multiple of 256"),
    (lambda: formats.row_bytes("IQ4_XS", 32), "multiple of 256"),
    (lambda: quant.quantize(np.full((1, 32), np.nan, np.float32), "q5_0"), "NaN or inf"),
    (lambda: quant.quantize(np.r_[np.zeros(31), np.inf][None].astype(np.float32), "q4_1"), "NaN or inf"),
    (lambda: iquant.quantize(np.full((1, 32), -np.inf, np.float32), "iq4_nl"), "NaN or inf"),
    (lambda: iquant.quantize(np.full((1, 256), np.nan, np.float32), "iq4_xs"), "NaN or inf"),
    (lambda: iquant.quantize(np.zeros(256, np.float32), "iq4_xs"), r"\[n, k\]"),
    (lambda: iquant.quantize(np.zeros((1, 32), np.float32), "iq4_ks"), "qtype must be one of"),
    (lambda: iquant.dequantize(np.zeros((1, 17), np.uint8), "iq4_nl", 32), r"\[n, 18\] bytes"),
    (lambda: quant.dequantize(np.zeros((1, 22), np.uint8), "q5_1", 32), r"\[n, 24\] bytes"),
    (lambda: quant.dequantize_packed(np.zeros(22, np.uint8), "q5_0", 1, 32), "packed layout"),
    (lambda: formats.quantize(np.zeros((1, 32), np.float32), "IQ4_KS"), "block type must be one of"),
])
def test_bad_input_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


@pytest.mark.parametrize("qtype", LEGACY)
def test_the_repacked_legacy_layout_holds_the_same_weights(qtype):
    """kernels.gemv.repack's layout for the legacy blocks (pack_legacy), read back from its own
    definition, gives dequantize's values exactly, on quantized weights and on random bytes (every
    fifth-bit pattern), with the same number of bytes."""
    rng = np.random.default_rng(5)
    n, k = 3, 96
    quantized = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    noise = rng.integers(0, 256, quantized.shape, dtype=np.uint8).reshape(n, k // 32, -1)
    heads = 2 if qtype == "q5_0" else 4
    noise[..., :heads] = rng.uniform(-2, 2, (n, k // 32, heads // 2)).astype(np.float16).view(np.uint8)
    for data in (quantized, noise.reshape(n, -1)):
        packed = quant.pack_legacy(data, qtype, n, k)
        assert packed.size == data.size
        np.testing.assert_array_equal(quant.dequantize_packed_legacy(packed, qtype, n, k),
                                      quant.dequantize(data, qtype, k))


@pytest.mark.parametrize("qtype", iquant.QTYPES)
def test_the_repacked_iq4_layout_holds_the_same_weights(qtype):
    """kernels.gemv.repack's layout for the IQ4s (reference.iquant.pack), read back from its own
    definition, gives dequantize's values exactly, on quantized weights and on random bytes (every
    scale and level), with the same number of bytes."""
    rng = np.random.default_rng(6)
    n, k = 3, 512
    quantized = iquant.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    noise = rng.integers(0, 256, quantized.shape, dtype=np.uint8).reshape(n, k // BLOCK[qtype], -1)
    noise[..., :2] = rng.uniform(-0.01, 0.01, (n, k // BLOCK[qtype], 1)).astype(np.float16).view(np.uint8)
    for data in (quantized, noise.reshape(n, -1)):
        packed = iquant.pack(data, qtype, n, k)
        assert packed.size == data.size
        np.testing.assert_array_equal(iquant.dequantize_packed(packed, qtype, n, k), iquant.dequantize(data, qtype, k))
