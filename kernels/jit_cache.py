"""Each CUDA kernel instantiation compiled once per machine, not once per process.

MLX 0.32.4 compiles a custom kernel with NVRTC the first time a process launches it (0.5-0.7 s
each; a model needs about 25, so the first tokens took 13-17 s, harness/NOTES.md) and keeps the
result in memory only. Its loader does look on disk first, for every module, custom kernels
included: `$MLX_PTX_CACHE_DIR/<module>.ptx` (PTX or a cubin) and `<module>.txt` (kernel name, tab,
symbol); it just never writes a custom kernel there. So lathe does:

- it rebuilds, byte for byte, the CUDA source MLX generates around a body (`mlx_source`, after
  mlx/backend/cuda/custom_kernel.cpp) and names the module as MLX does: the kernel's name, its
  template constants, `_`, then std::hash of that whole source in hex (libstdc++'s _Hash_bytes,
  called through ctypes, so the value is MLX's own);
- it compiles that source with NVRTC as MLX would (MLX's own device headers, read out of
  libmlx.so; its options) for this GPU's architecture, and writes the cubin and its symbol there.

Nothing here can make MLX run a wrong kernel: the module's name holds a hash of its complete
source, so a file is found only for the source it was compiled from. A name computed wrongly,
or a machine where any step fails, is a miss, and MLX compiles as it always did (a warning
says so, once). tests/test_jit_cache.py proves on the GPU that the rebuilt source is MLX's (its
verbose print) for every kernel the small checks launch, and that MLX runs what it finds (a
module planted under a name computes something else, and that is what runs).

Instantiations are compiled when first launched (`ensure`, from kernels.runtime.launch), or
ahead, in parallel worker processes, from recorded launches (`prepare`: the decoder records a
forward() of each token count before it runs it; `lathe compile` records every check case).

The cubins also say what a launch costs an SM: `resident` asks the driver's occupancy calculator
how many threadgroups of a module fit at once (the blocks size their claimed phases by it).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from kernels.nvrtc_worker import run_workers, write_module
from kernels.ptx import CompileError, run_nvrtc

# MLX's spellings (mlx/backend/cuda/utils, mlx/backend/common/utils at 0.32.4): the C type of an
# argument, and the type's name in a kernel's name.
_CUDA_TYPE = {"bool": "bool", "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t",
              "uint64": "uint64_t", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t",
              "int64": "int64_t", "float16": "__half", "bfloat16": "__nv_bfloat16",
              "float32": "float", "float64": "double"}
_TYPE_STRING = {"bool": "bool", "float16": "float16_t", "bfloat16": "bfloat16_t", "float32": "float",
                "float64": "double"}

_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""


def dtype_name(d) -> str:
    """'float16' for mx.float16."""
    return str(d).split(".")[-1]


@dataclass(frozen=True)
class Instance:
    """One compiled module: what MLX's generated source depends on. `source` and `header` are the
    strings handed to mx.fast.cuda_kernel (kernels.runtime.cuda_sources); inputs are
    (name, dtype, ndim), outputs (name, dtype), constants (name, value) in launch order."""

    name: str
    source: str
    header: str
    inputs: tuple[tuple[str, str, int], ...]
    outputs: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, object], ...]

    @property
    def kernel_name(self) -> str:
        """custom_kernel_<name><template hash>: the __global__ function's name."""
        tail = ""
        for _, v in self.constants:
            if isinstance(v, bool):
                tail += "_t" if v else "_f"
            elif isinstance(v, int):
                tail += f"_{v}"
            else:
                d = dtype_name(v)
                tail += "_" + _TYPE_STRING.get(d, f"{d}_t")
        return f"custom_kernel_{self.name}{tail}"

    def mlx_source(self) -> str:
        """The translation unit MLX's build_kernel makes of this instance, byte for byte."""
        parts = [_DEFAULT_HEADER, self.header, "namespace mlx::core::cu {\n\n",
                 "namespace cg = cooperative_groups;\n\n", f"__global__ void {self.kernel_name}(\n"]
        for name, dtype, ndim in self.inputs:
            parts.append(f"    const {_CUDA_TYPE[dtype]}* {name},\n")
            if ndim > 0:  # MLX finds these by searching the source it was given for the name
                if f"{name}_shape" in self.source:
                    parts.append(f"    const __grid_constant__ Shape {name}_shape,\n")
                if f"{name}_strides" in self.source:
                    parts.append(f"    const __grid_constant__ Strides {name}_strides,\n")
                if f"{name}_ndim" in self.source:
                    parts.append(f"    const __grid_constant__ int {name}_ndim,\n")
        outs = [f"    {_CUDA_TYPE[dtype]}* {name}" for name, dtype in self.outputs]
        parts.append(",\n".join(outs) + ") {\n")
        if self.constants:
            for k, v in self.constants:
                if isinstance(v, bool):
                    parts.append(f"  constexpr bool {k} = {str(v).lower()};\n")
                elif isinstance(v, int):
                    parts.append(f"  constexpr int {k} = {v};\n")
                else:
                    parts.append(f"  using {k} = {_CUDA_TYPE[dtype_name(v)]};\n")
            parts.append("\n")
        parts += [self.source, "\n}\n\n} // namespace mlx::core::cu\n"]
        return "".join(parts)

    def module_name(self, source: str | None = None) -> str:
        """MLX's name for the compiled module: fmt "{}_{:x}" of the kernel name and
        std::hash<std::string> of the source."""
        return f"{self.kernel_name}_{std_hash((source or self.mlx_source()).encode()):x}"


# ---- what MLX's process has: libstdc++'s hash, libmlx's device headers, NVRTC, the GPU ----------
@functools.cache
def _libstdcxx() -> ctypes.CDLL:
    lib = ctypes.CDLL("libstdc++.so.6")
    fn = lib._ZSt11_Hash_bytesPKvmm  # std::_Hash_bytes(const void*, size_t, size_t seed)
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


def std_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ (what MLX's module names use): _Hash_bytes with the
    seed its std::hash specialization passes."""
    return _libstdcxx()._ZSt11_Hash_bytesPKvmm(data, len(data), 0xC70F6907)


def _libmlx() -> Path:
    import mlx

    for p in mlx.__path__:
        lib = Path(p, "lib", "libmlx.so")
        if lib.exists():
            return lib
    raise FileNotFoundError("libmlx.so not found next to the mlx package")


def elf_sections(data: bytes) -> list[tuple]:
    """The section headers of a 64-bit little-endian ELF image (a shared library, a cubin):
    (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign,
    sh_entsize) each."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]


@functools.cache
def mlx_device_headers() -> dict[str, str]:
    """MLX's device headers as NVRTC gets them ('mlx/backend/cuda/device/utils.cuh' -> text):
    MLX embeds them in libmlx.so as arrays `jit_source_<stem>`, found by its symbol table."""
    data = _libmlx().read_bytes()
    sections = elf_sections(data)
    headers = {}
    for sec in sections:
        if sec[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sec[6]][4]
        for off in range(sec[4], sec[4] + sec[5], 24):
            st_name, _, _, shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
            name = data[strtab + st_name: data.index(b"\0", strtab + st_name)]
            if b"jit_source_" not in name or not name.startswith(b"_ZN3mlx4core"):
                continue
            stem = name.split(b"jit_source_", 1)[1][:-1].decode()  # ..._utilsE -> utils
            at = value - sections[shndx][3] + sections[shndx][4]
            text = data[at: at + size].split(b"\0", 1)[0].decode()
            prefix = f"mlx/backend/cuda/device/{stem}.".encode()
            ext = data.find(prefix)
            suffix = data[ext + len(prefix): ext + len(prefix) + 4].split(b"\0")[0].split(b'"')[0]
            headers.setdefault(f"mlx/backend/cuda/device/{stem}.{suffix.decode() or 'cuh'}", text)
    if "mlx/backend/cuda/device/utils.cuh" not in headers:
        raise FileNotFoundError(f"MLX's device headers are not in {_libmlx()}'s symbol table")
    return headers


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """The NVRTC that MLX's process loaded (so the same compiler), else kernels.ptx's search."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libnvrtc.so" in line and "builtins" not in line:
                return ctypes.CDLL(line.split()[-1])
    except OSError:
        pass
    from kernels import ptx

    return ptx.nvrtc()


@functools.cache
def compute_capability() -> tuple[int, int]:
    """(major, minor) of CUDA device 0 (MLX's default), asked of the driver."""
    cuda, dev, major, minor = _driver(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), 0):
        raise RuntimeError("the CUDA driver found no device")
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return major.value, minor.value


@functools.cache
def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0):
        raise RuntimeError("the CUDA driver did not initialize")
    return cuda


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"{what}: CUDA driver error {status}")


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of CUDA device 0."""
    cuda, dev, n = _driver(), ctypes.c_int(), ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    _check(cuda.cuDeviceGetAttribute(ctypes.byref(n), 16, dev), "MULTIPROCESSOR_COUNT")
    return n.value


@contextlib.contextmanager
def _loaded(cubin: bytes, symbol: str):
    """The function `symbol` of `cubin`, loaded into the device's primary context (which MLX's
    process shares) for the time of the block, and unloaded again."""
    cuda, dev, ctx = _driver(), ctypes.c_int(), ctypes.c_void_p()
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            _check(cuda.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
            try:
                _check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, symbol.encode()), "cuModuleGetFunction")
                yield cuda, fn
            finally:
                cuda.cuModuleUnload(module)
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)


def groups_per_sm(cubin: bytes, symbol: str, threads: int) -> int:
    """Blocks of `threads` threads of the kernel `symbol` in `cubin` that one SM holds at once:
    the driver's occupancy calculator (registers, shared memory, warps)."""
    n = ctypes.c_int()
    with _loaded(cubin, symbol) as (cuda, fn):
        _check(cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, threads, ctypes.c_size_t(0)),
               "cuOccupancy")
    return n.value


# cuFuncGetAttribute's CUfunction_attribute values (cuda.h)
_FUNCTION_ATTRIBUTES = {"registers": 4, "smem": 1, "local_bytes": 3}


def function_attributes(cubin: bytes, symbol: str) -> dict[str, int]:
    """What the driver says of the kernel `symbol` in `cubin`: registers a thread, static shared
    memory (bytes a threadgroup) and local memory (bytes a thread: the stack and any spills)."""
    out = {}
    with _loaded(cubin, symbol) as (cuda, fn):
        for name, attribute in _FUNCTION_ATTRIBUTES.items():
            value = ctypes.c_int()
            _check(cuda.cuFuncGetAttribute(ctypes.byref(value), attribute, fn), "cuFuncGetAttribute")
            out[name] = value.value
    return out


def module_symbol(path: Path) -> str:
    """The lowered symbol of a cached module's kernel (its .txt: kernel name, tab, symbol)."""
    _, symbol = path.with_suffix(".txt").read_text().rstrip("\n").split("\t")  # ValueError if malformed
    return symbol


def _cuda_home() -> str:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    return "/usr/local/cuda"


@functools.cache
def _options() -> tuple[bytes, ...]:
    """MLX's NVRTC options (jit_module.cpp): the architecture, CCCL shipped with MLX, CUDA's
    headers, functions on the device by default."""
    import mlx

    major, minor = compute_capability()
    opts = [f"--gpu-architecture=sm_{major}{minor}"]
    for p in mlx.__path__:
        if Path(p, "include", "cccl").exists():
            opts.append(f"--include-path={Path(p, 'include', 'cccl')}")
            break
    opts += [f"--include-path={_cuda_home()}/include", "--device-as-default-execution-space"]
    return tuple(o.encode() for o in opts)


def compile_cubin(source: str, kernel: str, file_name: str = "kernel.cu") -> tuple[bytes, str]:
    """NVRTC: (cubin, lowered symbol of `kernel`) of one translation unit, compiled as MLX does."""
    return run_nvrtc(_nvrtc(), source, file_name, _options(), mlx_device_headers(), kernel, cubin=True)


# ---- the cache ------------------------------------------------------------------------------------
def default_dir() -> Path:
    """Where lathe keeps compiled modules: per MLX version and GPU architecture, since a module's
    name does not say which GPU its cubin is for."""
    major, minor = compute_capability()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lathe" / "cuda-modules" / f"mlx-{mx.__version__}-sm_{major}{minor}"


_state = {"dir": None, "off": None}
NAME_MAX = 255  # bytes of a file name (Linux): a longer module name is left to MLX to compile
_known: set = set()


def activate() -> Path | None:
    """Point MLX's on-disk module cache at lathe's (unless $MLX_PTX_CACHE_DIR already names one):
    called before MLX compiles anything, as MLX reads the variable once. Returns the directory,
    or None (and a warning) where this machine cannot take part."""
    if _state["dir"] is None and _state["off"] is None:
        try:
            if not os.environ.get("MLX_PTX_CACHE_DIR"):
                os.environ["MLX_PTX_CACHE_DIR"] = str(default_dir())
            path = Path(os.environ["MLX_PTX_CACHE_DIR"])
            path.mkdir(parents=True, exist_ok=True)
            std_hash(b"")
            _state["dir"] = path
        except (OSError, RuntimeError, AttributeError) as exc:
            _disable(exc)
    return _state["dir"]


def _disable(exc: BaseException) -> None:
    _state["dir"], _state["off"] = None, str(exc)
    print(f"lathe: kernel cache off, each process compiles its kernels ({exc})", file=sys.stderr)


def _job(inst: Instance) -> tuple[str, str, str]:
    """(MLX's source, the kernel's name as MLX looks it up, the module's path in the cache)."""
    source = inst.mlx_source()
    return source, f"mlx::core::cu::{inst.kernel_name}", str(_state["dir"] / f"{inst.module_name(source)}.ptx")


def cached(inst: Instance) -> Path | None:
    """The module file MLX would load for `inst`, if it is there."""
    if _state["dir"] is None:
        return None
    path = Path(_job(inst)[2])
    return path if len(path.name) <= NAME_MAX and path.exists() else None


def _build(inst: Instance) -> str | None:
    """Compile `inst` into the cache unless its module is there; NVRTC's log where the body does
    not compile (the launch is then left to MLX, which reports the error as it always did)."""
    source, kernel, path = _job(inst)
    if len(Path(path).name) > NAME_MAX:  # MLX cannot open it either: it compiles the module itself
        return None
    try:
        if not Path(path).exists():
            cubin, symbol = compile_cubin(source, kernel, f"{Path(path).stem}.cu")
            write_module(Path(path), kernel, symbol, cubin)
    except CompileError as exc:
        return str(exc)
    except (OSError, RuntimeError, struct.error) as exc:  # no NVRTC, no headers: MLX compiles
        _disable(exc)
    return None


def ensure(inst: Instance) -> str | None:
    """`_build` once per process and instance."""
    if inst in _known or _state["dir"] is None:
        return None
    _known.add(inst)
    return _build(inst)


@functools.lru_cache(maxsize=256)
def resident(inst: Instance, threads: int) -> int | None:
    """Threadgroups of `threads` threads of `inst` that the whole GPU holds at once (SMs times the
    driver's occupancy for the module MLX runs: the cached cubin, compiled here first if need be),
    or None where this machine cannot tell (no cache, no NVRTC, no driver)."""
    if _state["dir"] is None:
        return None
    _build(inst)
    path = cached(inst)
    try:
        return sm_count() * groups_per_sm(path.read_bytes(), module_symbol(path), threads)
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def prepare(instances, workers: int | None = None) -> tuple[int, dict[str, str]]:
    """Compile the instances not yet cached, in parallel worker processes (NVRTC compiles one
    program at a time in a process: on the H200 16 threads took 60 s for 32 modules, 16
    processes 7.6 s; results/nvidia-h200/logs/nvrtc-parallel.log). Returns
    how many were compiled and NVRTC's log of each that failed, by kernel name."""
    todo = [i for i in dict.fromkeys(instances) if i not in _known]
    if _state["dir"] is None or not todo:
        return 0, {}
    jobs = {i: _job(i) for i in todo}
    missing = [i for i in todo if len(Path(jobs[i][2]).name) <= NAME_MAX and not Path(jobs[i][2]).exists()]
    _known.update(todo)
    workers = min(len(missing), workers or os.cpu_count() or 4)
    if workers <= 1:
        logs = [_build(i) for i in missing]
    else:
        try:
            shared = dict(nvrtc=_nvrtc()._name, headers=mlx_device_headers(), options=_options())
        except (OSError, RuntimeError, struct.error) as exc:
            _disable(exc)
            return 0, {}
        shares = [missing[w::workers] for w in range(workers)]
        results = run_workers([dict(shared, jobs=[jobs[i] for i in share]) for share in shares])
        logs = [None] * len(missing)
        for w, (result, share) in enumerate(zip(results, shares)):
            # a worker that died: its share here, one by one
            logs[w::workers] = result if result is not None else [_build(i) for i in share]
    return len(missing), {i.kernel_name: log for i, log in zip(missing, logs) if log}

