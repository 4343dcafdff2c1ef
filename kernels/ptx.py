"""Custom kernels compiled once to PTX with NVRTC (no GPU needed to compile).

Two users: `lathe compile` (every instantiation compiled on a machine without a GPU, so that a
body which does not compile fails here rather than on the device), and `lathe bench launch`,
which times a kernel launched from PTX with `mx.fast.precompiled_cuda_kernel` against the same
kernel through `mx.fast.cuda_kernel` (which rebuilds the whole source string on every call).

The CUDA source is what MLX's CUDA backend generates around a custom kernel body
(mlx/backend/cuda/custom_kernel.cpp): its default header, our header, a `__global__` signature of
the input pointers then the output pointers, and the template constants as `constexpr`. MLX's
device header is replaced by a stub holding what the generated code uses.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import tempfile
from pathlib import Path

CUDA_TYPES = {"float16": "__half", "float32": "float", "int32": "int32_t", "uint32": "uint32_t",
              "bfloat16": "__nv_bfloat16", "uint8": "uint8_t", "int8": "int8_t"}

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


def dtype_name(dtype) -> str:
    return str(dtype).split(".")[-1]


def kernel_name(base: str, constants: dict) -> str:
    """A C identifier naming one instantiation: the spec's name and its constants' values."""
    return re.sub(r"\W", "_", base + "".join(f"_{dtype_name(v)}" for v in constants.values()))


def cuda_source(name: str, body: str, header: str, inputs, outputs, constants,
                extern_c: bool = False) -> str:
    """The translation unit of one instantiation. inputs/outputs: (name, dtype name) pairs;
    extern_c gives the kernel an unmangled symbol (the PTX path looks it up by name)."""
    params = [f"const {CUDA_TYPES[d]}* {n}" for n, d in inputs]
    params += [f"{CUDA_TYPES[d]}* {n}" for n, d in outputs]
    consts = []
    for k, v in constants:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {str(v).lower()};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};")
        else:
            consts.append(f"  using {k} = {CUDA_TYPES[dtype_name(v)]};")
    linkage = 'extern "C" ' if extern_c else ""
    return (_MLX_DEFAULT_HEADER + header + "\nnamespace mlx::core::cu {\n"
            "namespace cg = cooperative_groups;\n"
            f"{linkage}__global__ void {name}({', '.join(params)}) {{\n" + "\n".join(consts)
            + "\n" + body + "\n}\n}\n")


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """libnvrtc: LATHE_NVRTC, the CUDA toolkit, the nvidia-cuda-nvrtc wheel, or the one MLX's
    CUDA backend already loaded (by its soname)."""
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
    for soname in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            return ctypes.CDLL(soname)
        except OSError:
            continue
    raise FileNotFoundError("NVRTC not found: install nvidia-cuda-nvrtc or set LATHE_NVRTC")


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """CUDA headers (cuda_fp16.h, CCCL's cuda/std) and the stub of MLX's device header."""
    roots = [os.environ.get("LATHE_CUDA_INCLUDE")]
    roots += [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    roots += ["/usr/local/cuda/include"]
    include = next((r for r in roots if r and Path(r, "cuda_fp16.h").exists()), None)
    if include is None:
        raise FileNotFoundError("no cuda_fp16.h found: set LATHE_CUDA_INCLUDE (or CUDA_HOME)")
    dirs = [include, f"{include}/cccl"]
    try:  # MLX's CUDA wheel ships CCCL too
        import mlx

        dirs += [str(Path(p, "include", "cccl")) for p in mlx.__path__]
    except ImportError:
        pass
    stub = Path(tempfile.mkdtemp(prefix="lathe-nvrtc-"), "mlx/backend/cuda/device/utils.cuh")
    stub.parent.mkdir(parents=True)
    stub.write_text(_MLX_UTILS_STUB)
    return (*dirs, str(stub.parents[4]))


class CompileError(RuntimeError):
    pass


def compile_ptx(source: str, name: str, arch: str = "compute_90") -> bytes:
    """NVRTC: CUDA source -> PTX (raises CompileError with NVRTC's log)."""
    lib = nvrtc()
    opts = [b"--std=c++17", f"-arch={arch}".encode()] + [f"-I{d}".encode() for d in include_dirs()]
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None):
        raise CompileError("nvrtcCreateProgram failed")
    try:
        argv = (ctypes.c_char_p * len(opts))(*opts)
        if lib.nvrtcCompileProgram(prog, len(opts), argv) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise CompileError(f"{name}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.raw.rstrip(b"\0") + b"\0"
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
