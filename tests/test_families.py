"""Every family's cases, one test per case (as llama.cpp's test-backend-ops runs every op against
one reference): the reference self-checks on the CPU, and the check cases of `lathe check` on the
GPU (the same cases, so `pytest -m gpu` and `lathe check` cannot drift apart)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.check import run_case
from harness.suites import families

REFERENCE = [case for fam in families().values() for case in fam.reference_cases()]
CHECKS = [case for fam in families().values() for case in fam.check_cases()]


@pytest.mark.parametrize("case", REFERENCE, ids=[f"{c.family}:{c.id}" for c in REFERENCE])
def test_reference(case):
    result = run_case(case)
    assert result.passed, result.failures()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CHECKS, ids=[f"{c.family}:{c.id}" for c in CHECKS])
def test_against_reference(case):
    result = run_case(case)
    assert result.passed, result.failures()


def test_fp16_steps_can_fail():
    """within_fp16_steps (the K-quants' dequantize and embedding checks): one fp16 step from the
    reference passes, two fail, and so does a NaN."""
    import numpy as np

    from harness.check import within_fp16_steps

    ref = np.array([1.0, -3.0, 1000.0], np.float32)
    one = (ref + np.spacing(ref.astype(np.float16)).astype(np.float32)).astype(np.float16)
    two = (ref + 2 * np.spacing(ref.astype(np.float16)).astype(np.float32)).astype(np.float16)
    assert within_fp16_steps("one step", one, ref).passed
    assert not within_fp16_steps("two steps", two, ref).passed
    assert not within_fp16_steps("NaN", np.array([np.nan, -3.0, 1000.0], np.float16), ref).passed


def test_compare_residual_allows_the_outputs_own_rounding_only():
    """compare_residual (the blocks' x_out): an fp16 output whose added part is small against x
    passes at its own rounding (a plain relative error of out - x would not), and fails when it
    is off by 2% of it, or NaN. (Errors below one step of the output are beyond its resolution.)"""
    from harness.check import compare, compare_residual

    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096)
    want = x + 0.02 * rng.standard_normal(4096)
    rounded = want.astype(np.float16)
    assert compare_residual("rounded", rounded, want, x, 4e-3).passed
    assert not compare("plain", rounded.astype(np.float64) - x, want - x, 4e-3).passed
    off = (want + 0.02 * (want - x)).astype(np.float16)
    assert not compare_residual("off by 2%", off, want, x, 4e-3).passed
    assert not compare_residual("NaN", np.where(np.arange(4096) == 7, np.nan, rounded), want, x, 4e-3).passed


def test_compare_products_floors_a_cancelling_sum_at_the_products_size():
    """compare_products (the GEMV checks): one output whose dot product cancels to a small part
    of its terms passes with an error of the staging's size (2.6e-5 of the terms, 5e-5 here),
    which a plain relative error fails; an output off by 1% of the products' size fails, and so
    does a NaN."""
    from harness.check import compare, compare_products

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 256))
    w = rng.standard_normal((1, 256))
    w[0] -= (x[0] @ w[0] - 0.3) / (x[0] @ x[0]) * x[0]  # x . w = 0.3, against terms of size 16
    want = x @ w.T
    size = np.linalg.norm(x) * np.linalg.norm(w) / np.sqrt(256)
    staged = want + 5e-5 * size
    assert compare_products("cancelling", staged, want, x, w, 2e-3).passed
    assert not compare("plain", staged, want, 2e-3).passed
    assert not compare_products("off by 1%", want + 0.01 * size, want, x, w, 2e-3).passed
    assert not compare_products("NaN", np.full_like(want, np.nan), want, x, w, 2e-3).passed
    wide = rng.standard_normal((3, 256)), rng.standard_normal((40, 256))  # many outputs: as before
    ref = wide[0] @ wide[1].T
    assert compare_products("3 x 40", ref * 1.001, ref, *wide, 2e-3).rel_err == pytest.approx(1e-3, rel=0.1)
