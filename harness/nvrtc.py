"""Compile every kernel instantiation for CUDA without a GPU: `lathe compile [family]`.

Device time is scarce; a body that does not compile on NVRTC should fail here, not there. The
family's check cases are run with `kernels.runtime.launch` replaced by a recorder (outputs are
zeros, comparisons are ignored), which collects each distinct kernel instantiation: its source,
its input and output dtypes and its template constants. Each is then wrapped the way MLX's CUDA
backend wraps a custom kernel (its default header, our header, a generated `__global__`
signature, constants as `constexpr`) and compiled with NVRTC for sm_90.

Needs NVRTC (libnvrtc.so, e.g. from the nvidia-cuda-nvrtc wheel; set LATHE_NVRTC to its path) and
the CUDA headers (cuda_fp16.h and CCCL's cuda/std; set LATHE_CUDA_INCLUDE, default
/usr/local/cuda/include). MLX's own device header is replaced by a stub holding what the
generated code uses. This checks compilation only; the device run checks results.
"""

from __future__ import annotations

import ctypes
import glob
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_CUDA_TYPES = {"float16": "__half", "float32": "float", "int32": "int32_t", "uint32": "uint32_t",
               "bfloat16": "__nv_bfloat16", "uint8": "uint8_t", "int8": "int8_t"}

# What MLX's default header provides to custom kernels (mlx/backend/cuda/custom_kernel.cpp).
_MLX_DEFAULT_HEADER = """#include "mlx/backend/cuda/device/utils.cuh"
#include <cooperative_groups.h>
#define inf cuda::std::numeric_limits<float>::infinity()
"""
_MLX_UTILS_STUB = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
"""


@dataclass(frozen=True)
class Instantiation:
    name: str
    source: str
    inputs: tuple[tuple[str, str], ...]  # (name, dtype)
    outputs: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, object], ...]

    def cuda_source(self, header: str) -> str:
        params = [f"const {_CUDA_TYPES[d]}* {n}" for n, d in self.inputs]
        params += [f"{_CUDA_TYPES[d]}* {n}" for n, d in self.outputs]
        consts = []
        for k, v in self.constants:
            if isinstance(v, bool):
                consts.append(f"  constexpr bool {k} = {str(v).lower()};")
            elif isinstance(v, int):
                consts.append(f"  constexpr int {k} = {v};")
            else:
                consts.append(f"  using {k} = {_CUDA_TYPES[str(v).split('.')[-1]]};")
        return (_MLX_DEFAULT_HEADER + header + "\nnamespace mlx::core::cu {\n"
                "namespace cg = cooperative_groups;\n"
                f"__global__ void {self.name}({', '.join(params)}) {{\n" + "\n".join(consts)
                + "\n" + self.source + "\n}\n}\n")


def record_instantiations(cases) -> list[Instantiation]:
    """Run the cases with launches recorded instead of executed."""
    import mlx.core as mx

    import kernels.runtime as rt

    seen: dict[tuple, Instantiation] = {}

    def recorder(job):
        dtype = lambda d: str(d).split(".")[-1]
        inst = Instantiation(
            name=job.spec.name + "".join(f"_{v}" for v in job.constants.values()),
            source=job.spec.source(),
            inputs=tuple((n, dtype(a.dtype)) for n, a in zip(job.spec.inputs, job.inputs)),
            outputs=tuple((n, dtype(d)) for n, (_, d) in zip(job.spec.outputs, job.outputs)),
            constants=tuple(job.constants.items()),
        )
        seen.setdefault((inst.name, inst.source, inst.inputs, inst.outputs), inst)
        return [mx.zeros(tuple(s), d) for s, d in job.outputs]

    saved = rt.launch
    modules = _modules_binding_launch()
    try:
        rt.launch = recorder
        for m in modules:
            m.launch = recorder
        for case in cases:
            try:
                case.run(np.random.default_rng(0))
            except Exception:  # noqa: BLE001 - comparisons on zeros fail; only launches matter
                pass
    finally:
        rt.launch = saved
        for m in modules:
            m.launch = saved
    return list(seen.values())


def core_calls() -> list:
    """Launches that belong to no family: the compat probes and the peak's copy kernel, as
    cases with a run(rng) method like a family's check cases."""
    import mlx.core as mx

    from kernels import compat
    from kernels.bandwidth import copy16

    class Call:
        def __init__(self, fn):
            self.run = lambda rng: fn()

    h = lambda n: mx.zeros((n,), mx.float16)  # noqa: E731
    return [
        Call(lambda: compat.thread_ids((8, 4, 2), (4, 2, 2))),
        Call(lambda: compat.simd(mx.zeros((64,)), 32, 5)),
        Call(lambda: compat.memory(h(64), mx.zeros((64,), mx.uint32), h(64), 32)),
        Call(lambda: copy16(mx.zeros((64,), mx.uint32))),
    ]


def _modules_binding_launch():
    import sys

    import kernels.runtime as rt

    return [m for name, m in list(sys.modules.items())
            if name.startswith("kernels.") and getattr(m, "launch", None) is rt.launch
            and m is not rt]


def _nvrtc() -> ctypes.CDLL:
    path = os.environ.get("LATHE_NVRTC")
    candidates = [path] if path else []
    candidates += glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")
    try:
        import nvidia  # the nvidia-cuda-nvrtc wheel

        for root in nvidia.__path__:
            candidates += glob.glob(f"{root}/**/libnvrtc.so*", recursive=True)
    except ImportError:
        pass
    for c in candidates:
        if c and "builtins" not in c and "alt" not in c:
            # NVRTC loads its builtins library by name at compile time: load it first, globally.
            ctypes.CDLL(str(next(iter(glob.glob(f"{Path(c).parent}/libnvrtc-builtins.so*")), c)),
                        mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(c)
    raise FileNotFoundError("NVRTC not found: install nvidia-cuda-nvrtc or set LATHE_NVRTC")


def compile_all(instantiations: list[Instantiation], arch: str = "compute_90") -> list[tuple[str, str]]:
    """NVRTC-compile each instantiation; returns (name, log) for every failure."""
    from kernels.runtime import MSL_DIR

    lib = _nvrtc()
    include = os.environ.get("LATHE_CUDA_INCLUDE", "/usr/local/cuda/include")
    if not Path(include, "cuda_fp16.h").exists():
        raise FileNotFoundError(f"no cuda_fp16.h under {include}: set LATHE_CUDA_INCLUDE")
    header = (MSL_DIR / "cuda_compat.h").read_text() + "\n" + (MSL_DIR / "lathe.h").read_text()
    failures = []
    with tempfile.TemporaryDirectory() as stub:
        utils = Path(stub, "mlx/backend/cuda/device/utils.cuh")
        utils.parent.mkdir(parents=True)
        utils.write_text(_MLX_UTILS_STUB)
        opts = [b"--std=c++17", f"-arch={arch}".encode(), f"-I{include}".encode(),
                f"-I{include}/cccl".encode(), f"-I{stub}".encode()]
        for inst in instantiations:
            prog = ctypes.c_void_p()
            src = inst.cuda_source(header).encode()
            if lib.nvrtcCreateProgram(ctypes.byref(prog), src, inst.name.encode(), 0, None, None):
                raise RuntimeError("nvrtcCreateProgram failed")
            argv = (ctypes.c_char_p * len(opts))(*opts)
            if lib.nvrtcCompileProgram(prog, len(opts), argv) != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetProgramLog(prog, log)
                failures.append((inst.name, log.value.decode(errors="replace")))
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return failures
