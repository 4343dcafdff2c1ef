"""Native CUDA kernels: research variants beside the portable MSL bodies (DESIGN.md), for what
Metal's constructs cannot say. Today one: the prefill attention on Hopper's warpgroup MMA
(kernels/attention/prefill_wgmma.cu), which needs the sm_90a target that MLX's NVRTC build of
custom kernels does not name (it compiles for sm_90).

A native kernel is a whole CUDA translation unit with an extern "C" entry point, compiled here
with NVRTC for sm_90a to a cubin and launched with ``mx.fast.precompiled_cuda_kernel``: its
inputs' pointers, then its outputs', in order. MLX keeps one loaded module per kernel name, so
each instantiation's symbol carries its constants (the ENTRY macro below).

MLX names a precompiled kernel's module by a hash of the bytes it is handed, at every launch
(CustomKernel::eval_gpu): the prefill kernel's 52 KB cubin, 28 launches a Qwen3 prompt, was 13% of
the prompt's host time (kernels/loop/NOTES.md). So where nvFatbin is found a launch hands MLX a
compressed fatbin of the cubin instead (the `native_image` option), which the driver unpacks once
when MLX loads the module: 15 KB for that kernel.

Cubins are kept on disk beside lathe's MLX modules (kernels.jit_cache's directory, `native/`),
named by a digest of the source, NVRTC's options and NVRTC's version, so that processes share
them; `prepare` compiles a recording's instances in parallel worker processes. (A sweep of 1078
qmm_mma instances spent about 5 minutes of a device session compiling them one after another.)
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from kernels import options, runtime

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
    """(symbol, cubin) of one instantiation, once a process: what each launch hands MLX. From the
    disk cache where it is there, else compiled (and kept there)."""
    cached = _cache_file(path, stem, constants)
    if cached is not None and cached.exists():
        return entry_name(stem, dict(constants)), cached.read_bytes()
    binary = cubin(path, stem, constants)
    if cached is not None:
        from kernels.nvrtc_worker import write_whole

        write_whole(cached, binary)
    return entry_name(stem, dict(constants)), binary


def _program(path: str, stem: str, constants: tuple[tuple[str, int], ...]) -> tuple[str, str, list[bytes]]:
    """NVRTC's program of one instantiation: (source, file name, options)."""
    consts = dict(constants)
    opts = [b"--gpu-architecture=sm_90a", b"--std=c++17", f"-DENTRY={entry_name(stem, consts)}".encode()]
    opts += [f"-D{k}={v}".encode() for k, v in consts.items()]
    return (runtime.KERNEL_ROOT / path).read_text(), Path(path).name, opts


def cubin(path: str, stem: str, constants: tuple[tuple[str, int], ...]) -> bytes:
    """NVRTC: the kernel at kernels/<path> with its constants as -D defines and ENTRY (its
    symbol), for sm_90a. No GPU is needed; raises kernels.ptx.CompileError with NVRTC's log."""
    from kernels import ptx

    source, file_name, opts = _program(path, stem, constants)
    out, _ = ptx.run_nvrtc(_nvrtc(), source, file_name, opts, cubin=True)
    return out


def _cache_file(path: str, stem: str, constants: tuple[tuple[str, int], ...]) -> Path | None:
    """Where the disk cache keeps this instantiation's cubin (None where the cache is off): a
    digest of what NVRTC is given and its version, so an edit to the source is a new file."""
    from kernels import jit_cache

    root = jit_cache._state["dir"]
    if root is None:
        return None
    try:
        compiler = _nvrtc_version(_nvrtc())
    except (OSError, RuntimeError, FileNotFoundError, AttributeError):
        return None
    source, file_name, opts = _program(path, stem, constants)
    if "#include" in source:  # what it includes is not in the digest: no file, compiled each process
        return None
    digest = hashlib.sha256("\0".join([compiler, file_name, source, *(o.decode() for o in opts)]).encode())
    return Path(root) / "native" / f"{stem}-{digest.hexdigest()[:32]}.cubin"


def _nvrtc_version(lib) -> str:
    """NVRTC's version: the same compiler whether the process found it through MLX or by search."""
    import ctypes

    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)):
        raise RuntimeError("nvrtcVersion failed")
    return f"nvrtc {major.value}.{minor.value}"


def prepare(keys, workers: int | None = None) -> tuple[int, dict[str, str]]:
    """Compile into the disk cache, in parallel worker processes (kernels.nvrtc_worker), the
    instantiations (path, stem, constants) it lacks. Returns how many were compiled and NVRTC's
    log of each that failed, by symbol; nothing where the disk cache is off."""
    todo = {}
    for key in dict.fromkeys(keys):
        target = _cache_file(*key)
        if target is not None and not target.exists():
            todo[key] = target
    if not todo:
        return 0, {}
    from kernels.nvrtc_worker import run_workers

    items = list(todo.items())
    workers = max(1, min(len(items), workers or os.cpu_count() or 4))
    shares = [items[w::workers] for w in range(workers)]
    nvrtc = _nvrtc()._name
    results = run_workers([dict(nvrtc=nvrtc, native=[(*_program(*key), str(target)) for key, target in share])
                           for share in shares])
    failures = {}
    for result, share in zip(results, shares):  # a worker that died: its share compiles at its first launch
        failures.update({entry_name(key[1], dict(key[2])): log
                         for (key, _), log in zip(share, result or [None] * len(share)) if log})
    return len(items), failures


@functools.cache
def nvfatbin():
    """libnvfatbin (the nvidia-nvfatbin wheel, the CUDA toolkit, LATHE_NVFATBIN), or None."""
    import ctypes

    from kernels.ptx import cuda_library_paths

    candidates = [os.environ.get("LATHE_NVFATBIN") or "", *cuda_library_paths("nvfatbin")]
    for c in [*filter(None, candidates), "libnvfatbin.so.13", "libnvfatbin.so.12"]:
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


@functools.cache
def image(cubin: bytes, form: str = "auto") -> bytes:
    """What a launch hands MLX for `cubin`: the cubin itself, or a fatbin holding it compressed
    ("fatbin"; "auto": where nvFatbin is found). Raises where "fatbin" is asked and nvFatbin is not
    there, or refuses the cubin."""
    import ctypes

    if form not in ("auto", "fatbin", "cubin"):
        raise ValueError(f"form must be 'auto', 'fatbin' or 'cubin', got {form!r}")
    lib = nvfatbin() if form != "cubin" else None
    if lib is None:
        if form == "fatbin":
            raise RuntimeError("native_image=fatbin: libnvfatbin not found (the nvidia-nvfatbin wheel, "
                               "or LATHE_NVFATBIN)")
        return cubin
    handle = ctypes.c_void_p()
    opts = (ctypes.c_char_p * 1)(b"-compress-all")  # (a cubin under 64 KB is not compressed otherwise)
    if lib.nvFatbinCreate(ctypes.byref(handle), opts, ctypes.c_size_t(1)):
        raise RuntimeError("nvFatbinCreate failed")
    try:
        arch = f"{NATIVE_ARCH[0]}{NATIVE_ARCH[1]}a".encode()
        if lib.nvFatbinAddCubin(handle, cubin, ctypes.c_size_t(len(cubin)), arch, b"lathe"):
            raise RuntimeError("nvFatbinAddCubin refused the cubin")
        size = ctypes.c_size_t()
        if lib.nvFatbinSize(handle, ctypes.byref(size)):
            raise RuntimeError("nvFatbinSize failed")
        out = ctypes.create_string_buffer(size.value)
        if lib.nvFatbinGet(handle, out):
            raise RuntimeError("nvFatbinGet failed")
        return out.raw
    finally:
        lib.nvFatbinDestroy(ctypes.byref(handle))


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
    launches are recorded (no GPU) it compiles the kernel and returns zeros; inside a
    recording(keep_prepared=True) it only notes the instantiation (`.native`), for `prepare`."""
    key = (path, stem, tuple(constants.items()))
    if runtime.recording_launches() and runtime.native_sink() is not None:
        runtime.native_sink().append(key)
        return [mx.zeros(tuple(s), d) for s, d in outputs]
    name, binary = instance(*key)
    binary = image(binary, options.get("native_image"))
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
