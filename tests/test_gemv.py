"""Quantized GEMV: argument checks (CPU), the formats' reference self-checks (CPU), and every
check case against float64 on dequantized weights (GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from harness.check import run_case
from harness.suites.gemv import check_cases, reference_cases
from kernels.gemv import gemv_v1

N, K = 8, 64


def x16(m=1, k=K):
    return mx.zeros((m, k), mx.float16)


def w8(nbytes):
    return mx.zeros((nbytes,), mx.uint8)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: gemv_v1(x16(k=40), w8(N * 40), "q4_0", N, 40), "multiple of 32"),
        (lambda: gemv_v1(mx.zeros((1, K)), w8(N * 36), "q4_0", N, K), "float16"),
        (lambda: gemv_v1(x16(5), w8(N * 36), "q4_0", N, K), "M in 1..4"),
        (lambda: gemv_v1(x16(k=96), w8(N * 36), "q4_0", N, K), r"\[M, K=64\]"),
        (lambda: gemv_v1(x16(), w8(N * 36 + 1), "q4_0", N, K), "takes 288"),
        (lambda: gemv_v1(x16(), w8(N * 36), "q8_0", N, K), "takes 544"),
        (lambda: gemv_v1(x16(), mx.zeros((N * 36,), mx.int8), "q4_0", N, K), "uint8"),
        (lambda: gemv_v1(x16(), w8(N * 36), "q5_0", N, K), "qtype"),
        (lambda: gemv_v1(x16(), w8(0), "q4_0", 0, K), "N must be positive"),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("case", reference_cases(), ids=lambda c: c.id)
def test_reference_formats(case):
    result = run_case(case)
    assert result.passed, result.failures()


CASES = check_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_against_reference(case):
    result = run_case(case)
    assert result.passed, result.failures()
