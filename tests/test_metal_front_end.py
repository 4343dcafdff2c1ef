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


# CUDA's own device functions that stand for the MSL ones of the same name and meaning (float
# overloads): cuda_compat.h needs no mapping for them
CUDA_NAMES = {"cos", "sin", "exp", "exp2", "fabs", "floor", "fma", "max", "min", "pow", "rint", "rsqrt", "trunc"}
_NOT_FUNCTIONS = {"__attribute__", "address_space", "ext_vector_type", "static_assert", "__builtin_bit_cast",
                  "sizeof", "decltype", "operator", "vec", "elements", "thread_elements"}


def _model_functions() -> set[str]:
    import re

    from kernels.runtime import MSL_DIR

    text = "".join(re.sub(r"//[^\n]*", "", p.read_text()) for p in (MSL_DIR / "metal_model").iterdir())
    return {n for n in re.findall(r"\b([a-z_][a-z0-9_]*)\s*\(", text) if n not in _NOT_FUNCTIONS}


def test_the_model_and_the_compat_header_cover_one_subset():
    """The model of Metal declares the MSL functions that the bodies and lathe.h use, and no
    others; each one the portable code uses (the bodies, and lathe.h outside its Metal branch)
    is provided on CUDA: named in cuda_compat.h, or one of CUDA's own (CUDA_NAMES)."""
    import re

    from kernels.runtime import KERNEL_ROOT, MSL_DIR

    def names(text: str) -> set[str]:
        return set(re.findall(r"\b[A-Za-z_]\w*\b", re.sub(r"//[^\n]*", "", text)))

    lathe = (MSL_DIR / "lathe.h").read_text()
    metal_branch = lathe[lathe.index("#ifdef __METAL_VERSION__"):lathe.index("#endif")]
    portable = names("".join(p.read_text() for p in KERNEL_ROOT.glob("*/*.metal")) + lathe.replace(metal_branch, ""))
    model = _model_functions()
    assert CUDA_NAMES <= model
    assert model <= portable | names(metal_branch), f"declared and never used: {sorted(model - portable - names(metal_branch))}"
    compat = names((MSL_DIR / "cuda_compat.h").read_text())
    missing = sorted(n for n in model & portable if n not in compat | CUDA_NAMES)
    assert not missing, f"used by the bodies, declared by the model, not provided on CUDA: {missing}"


@pytest.mark.parametrize("target", ["cuda", "metal"])
def test_the_wrappers_threadgroup_memory_is_the_sources(target):
    """The threadgroup memory that the GEMV and tiled-prefill wrappers size their launches with
    (v2_smem_bytes, v3_smem_bytes, prefill_threadgroup_bytes) is what the instantiated source
    declares (measured by the front end), and it fits the target's budget (kernels.backends)."""
    import numpy as np

    from harness.metal import front_end, launch_source
    from kernels import attention, backends, gemv
    from kernels.runtime import recording
    from reference.quant import quantize

    blocks = mx.array(quantize(np.ones((64, 14336), np.float32), "q8_0"))
    packed = gemv.repack(blocks, "q8_0", 64, 14336)
    x = mx.zeros((3, 14336), mx.float16)
    with recording(target) as rec:
        gemv.gemv_v2(x, blocks, "q8_0", 64, 14336)
        gemv.gemv_v3(x, packed, "q8_0", 64, 14336)
        for d, paged in ((128, False), (128, True), (256, False), (256, True)):
            cache = (mx.zeros((4, 2, d // 8, 16, 8), mx.float16), mx.zeros((4, 2, d, 16), mx.float16)) if paged \
                else (mx.zeros((2, 64, d), mx.float16), mx.zeros((2, 64, d), mx.float16))
            attention.prefill_attention(mx.zeros((40, 4, d), mx.float16), *cache, 0, 0.1, kernel="tiled",
                                        block_table=np.arange(4, dtype=np.int32) if paged else None)
        budget = backends.threadgroup_memory()
    v2, v3, *prefills = rec.jobs
    c = v2.constants
    want = [gemv.v2_smem_bytes("q8_0", 3, c["R"], c["NSIMD"], c["XCHUNK"], c["SLOTS"]),
            gemv.v3_smem_bytes(3, v3.constants["XCHUNK"], v3.constants["NSIMD"])]
    want += [attention.prefill_threadgroup_bytes(j.constants["D"], j.constants["RB"], j.constants["BK"],
                                                 "table" in j.spec.inputs) for j in prefills]
    got = [front_end(launch_source(j))[1] for j in rec.jobs]
    assert got == want and max(got) <= budget == backends.THREADGROUP_MEMORY[target]
