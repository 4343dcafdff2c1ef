"""Every kernel instantiation compiles with NVRTC as MLX's CUDA backend would compile it: runs
where NVRTC and the CUDA headers are found (a developer machine with the CUDA toolkit), skipped
with the reason elsewhere. It needs no GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.nvrtc import _nvrtc, compile_all, core_calls, record_instantiations
from harness.suites.rope import check_cases


def _available() -> str:
    try:
        _nvrtc()
    except (FileNotFoundError, OSError) as exc:
        return str(exc)
    include = os.environ.get("LATHE_CUDA_INCLUDE", "/usr/local/cuda/include")
    if not Path(include, "cuda_fp16.h").exists():
        return f"no CUDA headers under {include}"
    return ""


@pytest.mark.skipif(bool(_available()), reason=_available() or "available")
def test_every_instantiation_compiles_with_nvrtc():
    insts = record_instantiations(core_calls() + check_cases(small=True))
    assert len(insts) > 50  # every constant combination the checks launch, plus the probes
    failures = compile_all(insts)
    assert not failures, "\n\n".join(f"{name}\n{log[:2000]}" for name, log in failures)
