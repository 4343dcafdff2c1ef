"""Native CUDA kernels: research variants beside the portable MSL bodies (DESIGN.md), for what
Metal's constructs cannot say. Today one: the prefill attention on Hopper's warpgroup MMA
(kernels/attention/prefill_wgmma.cu), which needs the sm_90a target that MLX's NVRTC build of
custom kernels does not name (it compiles for sm_90).

A native kernel is a whole CUDA translation unit with an extern "C" entry point, compiled here
with NVRTC for sm_90a to a cubin and launched with ``mx.fast.precompiled_cuda_kernel``: its
inputs' pointers, then its outputs', in order. MLX keeps one loaded module per kernel name, so
each instantiation's symbol carries its constants (the ENTRY macro below).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from kernels import runtime

NATIVE_ARCH = (9, 0)  # the one architecture the native kernels are written for (wgmma: sm_90a)


@functools.cache
def unavailable_reason() -> str:
    """Why native kernels cannot run here ('' where they can): they need MLX's CUDA backend on a
    GPU of compute capability 9.0 (H100, H200)."""
    if runtime.backend() != "cuda":
        return f"native CUDA kernels need MLX's CUDA backend (this one: {runtime.backend()})"
    from kernels import jit_cache

    cc = jit_cache.compute_capability()
    if cc != NATIVE_ARCH:
        return f"native CUDA kernels are built for sm_90a (Hopper); this GPU is sm_{cc[0]}{cc[1]}"
    return ""


def available() -> bool:
    return not unavailable_reason()


def entry_name(stem: str, constants: dict[str, int]) -> str:
    """The extern "C" symbol of one instantiation: the stem and its constants."""
    return stem + "".join(f"_{k.lower()}{v}" for k, v in constants.items())


@functools.cache
def instance(path: str, stem: str, constants: tuple[tuple[str, int], ...]) -> tuple[str, bytes]:
    """(symbol, cubin) of one instantiation, built once a process: what each launch hands MLX."""
    return entry_name(stem, dict(constants)), cubin(path, stem, constants)


def cubin(path: str, stem: str, constants: tuple[tuple[str, int], ...]) -> bytes:
    """NVRTC: the kernel at kernels/<path> with its constants as -D defines and ENTRY (its
    symbol), for sm_90a. No GPU is needed; raises kernels.ptx.CompileError with NVRTC's log."""
    from kernels import ptx

    source = (runtime.KERNEL_ROOT / path).read_text()
    consts = dict(constants)
    opts = [b"--gpu-architecture=sm_90a", b"--std=c++17", f"-DENTRY={entry_name(stem, consts)}".encode()]
    opts += [f"-D{k}={v}".encode() for k, v in consts.items()]
    out, _ = ptx.run_nvrtc(_nvrtc(), source, Path(path).name, opts, cubin=True)
    return out


def _nvrtc():
    """The NVRTC MLX's process loaded where there is one, else kernels.ptx's search."""
    from kernels import jit_cache

    return jit_cache._nvrtc()


def launch(path: str, stem: str, constants: dict[str, int], inputs: Sequence[mx.array],
           outputs: Sequence[tuple[tuple[int, ...], mx.Dtype]], grid: tuple[int, int, int],
           threadgroup: tuple[int, int, int], shared_memory: int,
           scalars: Sequence[int] = ()) -> list[mx.array]:
    """One launch of a native kernel (grid in threads, as kernels.runtime's launches): its
    parameters are the inputs' and outputs' pointers, then `scalars` (32-bit ints). Outputs
    are poisoned inside kernels.runtime.poisoned_outputs, as every other launch's. While
    launches are recorded (no GPU) it compiles the kernel and returns zeros."""
    name, binary = instance(path, stem, tuple(constants.items()))
    if runtime.recording_launches():
        return [mx.zeros(tuple(s), d) for s, d in outputs]
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    return mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=binary, inputs=list(inputs),
        output_shapes=[tuple(s) for s, _ in outputs], output_dtypes=[d for _, d in outputs],
        scalars=list(scalars), grid=grid, threadgroup=threadgroup, shared_memory=shared_memory,
        init_value=runtime.poison_value())
