"""`lathe compile --metal`: every instantiation the checks launch, as the Metal source that
mx.fast.metal_kernel builds, through clang's C++17 front end over lathe's model of Metal
(kernels/msl/metal_model). The check rejects what Metal rejects: the tests below show it failing
on each kind of mistake, beside a clean twin that passes (CPU; needs the libclang package)."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("clang.cindex", reason="the Metal front-end check needs the libclang package")

from harness.metal import front_end_errors, metal_source  # noqa: E402

CLEAN = """const uint i = thread_position_in_grid.x;
threadgroup float scratch[32];
scratch[thread_index_in_simdgroup] = float(x[i]);
threadgroup_barrier(mem_flags::mem_threadgroup);
const half2 h = half2(half(simd_sum(scratch[0])), half(1.0f));
const float v = float(h.x) * float(dims[0]);
y[i] = half(v) + as_type<half2>(load_wide<uint>(x, i)).y;
"""


def _errors(extra: str = "", clean: str = CLEAN) -> list[str]:
    # x: 64 halves (device memory), dims: 3 int32 (under 8 elements: constant memory), y: output
    src = metal_source("probe", clean + extra, '#include "lathe.h"',
                       [("x", mx.float16, (64,)), ("dims", mx.int32, (3,))], [("y", mx.float16)], {"N": 4})
    return front_end_errors(src.replace('#include "lathe.h"', _lathe_h()))


def _lathe_h() -> str:
    from kernels.runtime import MSL_DIR

    return (MSL_DIR / "lathe.h").read_text()


def test_a_clean_body_passes():
    assert _errors() == []


@pytest.mark.parametrize("mistake, message", [
    ("__syncthreads();", "__syncthreads"),  # CUDA, not Metal
    ("const half h2 = __float2half(1.0f);", "__float2half"),
    ("const uint s = __shfl_xor_sync(0xffffffffu, 1u, 1);", "__shfl_xor_sync"),
    ("half* p = x;", "cannot initialize"),  # a device pointer losing its address space
    ("threadgroup half* t = y;", "cannot initialize"),  # device memory as threadgroup memory
    ("device int32_t* d = writable(dims);", "writable"),  # dims is in constant memory
    ("atomic_fetch_add_explicit((device atomic_uint*)y, 1u, memory_order_acq_rel);", "memory_order_acq_rel"),
    ("const float z = exp(1.0f, 2.0f);", "exp"),
])
def test_what_metal_rejects_is_rejected(mistake, message):
    errors = _errors(mistake + "\n")
    assert errors and any(message in e for e in errors), errors


def test_every_instantiation_the_checks_launch_passes(capsys):
    """The whole sweep (`lathe compile --metal`): each distinct source of the small check cases'
    launches, every family."""
    from harness.cli import cmd_compile_metal

    assert cmd_compile_metal(None) == 0, capsys.readouterr().out[-3000:]
    assert " 0 failed" in capsys.readouterr().out
