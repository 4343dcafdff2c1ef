"""Every kernel instantiation compiles with NVRTC as MLX's CUDA backend would compile it: runs
where NVRTC and the CUDA headers are found (a developer machine with the CUDA toolkit), skipped
with the reason elsewhere. It needs no GPU."""

from __future__ import annotations

import pytest

from harness.nvrtc import compile_all, core_calls, record_instantiations
from harness.suites.rope import check_cases
from kernels import ptx


def _available() -> str:
    try:
        ptx.nvrtc(), ptx.include_dirs()
    except (FileNotFoundError, OSError) as exc:
        return str(exc)
    return ""


@pytest.mark.skipif(bool(_available()), reason=_available() or "available")
def test_every_instantiation_compiles_with_nvrtc():
    insts = record_instantiations(core_calls() + check_cases(small=True))
    assert len(insts) > 50  # every constant combination the checks launch, plus the probes
    failures = compile_all(insts)
    assert not failures, "\n\n".join(f"{name}\n{log[:2000]}" for name, log in failures)


@pytest.mark.skipif(bool(_available()), reason=_available() or "available")
def test_ptx_has_the_unmangled_kernel_symbol():
    """The ptx launch path finds the kernel by its name: extern "C" keeps it unmangled."""
    from kernels.jit_cache import Instance

    inst = Instance("lathe_probe", "out[0] = in[0] + N;", "", (("in", "int32", 1),),
                    (("out", "int32"),), (("N", 1),))
    src = inst.mlx_source().replace("__global__ void", 'extern "C" __global__ void', 1)
    text = ptx.compile_ptx(src, inst.kernel_name).decode()
    assert f".entry {inst.kernel_name}(" in text
    with pytest.raises(ptx.CompileError, match="undefined"):
        ptx.compile_ptx(src.replace("in[0]", "nowhere[0]"), "broken")
