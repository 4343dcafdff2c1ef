"""Custom kernels compiled once to PTX with NVRTC (no GPU needed to compile).

Two users: `lathe compile` (every instantiation compiled on a machine without a GPU, so that a
body which does not compile fails here rather than on the device), and `lathe bench launch`,
which times a kernel launched from PTX with `mx.fast.precompiled_cuda_kernel` against the same
kernel through `mx.fast.cuda_kernel` (which rebuilds the whole source string on every call).

The CUDA source is what MLX's CUDA backend generates around a custom kernel body
(kernels.jit_cache.Instance.mlx_source). Without MLX's CUDA build its device header is not at
hand, so a stub holding what the generated code uses stands in for it.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import tempfile
from pathlib import Path

_MLX_UTILS_STUB = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
"""


def cuda_library_paths(stem: str) -> list[str]:
    """lib<stem>.so* in the CUDA toolkit, then in the nvidia-* wheels (nvidia-cuda-nvrtc, ...)."""
    found = glob.glob(f"/usr/local/cuda/lib64/lib{stem}.so*")
    try:
        import nvidia

        for root in nvidia.__path__:
            found += glob.glob(f"{root}/**/lib{stem}.so*", recursive=True)
    except ImportError:
        pass
    return found


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """libnvrtc: LATHE_NVRTC, the CUDA toolkit, the nvidia-cuda-nvrtc wheel, or the one MLX's
    CUDA backend already loaded (by its soname)."""
    path = os.environ.get("LATHE_NVRTC")
    candidates = ([path] if path else []) + cuda_library_paths("nvrtc")
    for c in candidates:
        if c and "builtins" not in c and "alt" not in c:
            return load_nvrtc(c)
    for soname in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            return ctypes.CDLL(soname)
        except OSError:
            continue
    raise FileNotFoundError("NVRTC not found: install nvidia-cuda-nvrtc or set LATHE_NVRTC")


@functools.cache
def load_nvrtc(path: str) -> ctypes.CDLL:
    """libnvrtc at `path`. NVRTC loads its builtins library by name at compile time: the one
    beside it is loaded first, globally (a wheel's directory is on no loader path)."""
    ctypes.CDLL(str(next(iter(glob.glob(f"{Path(path).parent}/libnvrtc-builtins.so*")), path)),
                mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(path)


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


def _options(arch: str, *extra: bytes) -> list[bytes]:
    """NVRTC's options for lathe's CUDA source: C++17, `arch`, the include directories."""
    return [b"--std=c++17", f"-arch={arch}".encode(), *extra] + [f"-I{d}".encode() for d in include_dirs()]


def compile_ptx(source: str, name: str, arch: str = "compute_90") -> bytes:
    """NVRTC: CUDA source -> PTX (raises CompileError with NVRTC's log)."""
    ptx, _ = run_nvrtc(nvrtc(), source, name, _options(arch))
    return ptx.rstrip(b"\0") + b"\0"


def resource_usage(source: str, name: str, arch: str = "sm_90") -> dict[str, int]:
    """What ptxas gives a kernel compiled for `arch` (NVRTC to a cubin, ptxas -v): registers a
    thread, spill stores and loads and the stack frame (bytes a thread), static shared memory
    (bytes a threadgroup). No GPU needed: the occupancy a launch can reach follows from these."""
    log: list[str] = []
    run_nvrtc(nvrtc(), source, name, _options(arch, b"--ptxas-options=-v"), cubin=True, log_to=log)
    return parse_ptxas(log[0])


_PTXAS = {"registers": r"Used (\d+) registers", "stack": r"(\d+) bytes stack frame",
          "spill_stores": r"(\d+) bytes spill stores", "spill_loads": r"(\d+) bytes spill loads",
          "smem": r"(\d+) bytes smem"}


def parse_ptxas(log: str) -> dict[str, int]:
    """ptxas -v's figures for the one kernel in `log` (0 where ptxas leaves one out, as it does
    smem for a kernel with none); CompileError where it names no register count."""
    if re.search(_PTXAS["registers"], log) is None:
        raise CompileError(f"no ptxas register count in NVRTC's log:\n{log[-2000:]}")
    return {key: int(m.group(1)) if (m := re.search(pattern, log)) else 0 for key, pattern in _PTXAS.items()}


def run_nvrtc(lib, source: str, file_name: str, opts, headers: dict[str, str] | None = None,
              kernel: str | None = None, cubin: bool = False,
              log_to: list[str] | None = None) -> tuple[bytes, str | None]:
    """One NVRTC program: (PTX, or a cubin, and the lowered symbol of `kernel` if given). Headers
    (include name -> text) are handed over in memory, as MLX does; raises CompileError with
    NVRTC's log, which `log_to` also gets on success."""
    headers = headers or {}
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
    texts = (ctypes.c_char_p * len(headers))(*[t.encode() for t in headers.values()])
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), file_name.encode(), len(headers),
                              texts, names):
        raise CompileError("nvrtcCreateProgram failed")
    try:
        if kernel:
            lib.nvrtcAddNameExpression(prog, kernel.encode())
        failed = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if failed or log_to is not None:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            if failed:
                raise CompileError(f"{file_name}:\n{log.value.decode(errors='replace')}")
            log_to.append(log.value.decode(errors="replace"))
        symbol = None
        if kernel:
            lowered = ctypes.c_char_p()
            lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(lowered))
            symbol = lowered.value.decode()
        get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin
                         else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
        size = ctypes.c_size_t()
        get_size(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        get(prog, out)
        return out.raw, symbol
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
