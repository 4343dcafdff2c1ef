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
