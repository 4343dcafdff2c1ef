"""Every family's cases, one test per case (as llama.cpp's test-backend-ops runs every op against
one reference): the reference self-checks on the CPU, and the check cases of `lathe check` on the
GPU (the same cases, so `pytest -m gpu` and `lathe check` cannot drift apart)."""

from __future__ import annotations

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
