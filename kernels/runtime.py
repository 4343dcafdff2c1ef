"""Backend detection, kernel compilation and launch: the one place that talks to mx.fast.

One MSL body per kernel (``kernels/<family>/<name>.metal``) compiles with ``mx.fast.metal_kernel``
on Apple GPUs and with ``mx.fast.cuda_kernel`` plus ``msl/cuda_compat.h`` on NVIDIA GPUs. Kernel
objects are cached by name (MLX caches each compiled instantiation by its template constants).

`ptx_kernel` compiles an instantiation to PTX with NVRTC (kernels.ptx, the same translation unit
MLX builds) for ``mx.fast.precompiled_cuda_kernel``: `lathe bench launch` times that path against
``mx.fast.cuda_kernel``. It measured slower per call on the H200 (results/nvidia-h200/launch.csv),
so launches keep to ``cuda_kernel``. A likely cause, not measured: MLX hashes a custom kernel's
whole source at every launch, and PTX is longer than the CUDA source (`cuda_sources` below).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from kernels import jit_cache, options

KERNEL_ROOT = Path(__file__).resolve().parent
MSL_DIR = KERNEL_ROOT / "msl"


class NoGpuBackend(RuntimeError):
    """Raised when a kernel is launched on a machine with neither Metal nor CUDA."""

    def __init__(self) -> None:
        super().__init__(
            "NoGpuBackend: this MLX build has neither a Metal nor a CUDA backend (CPU only), so "
            "lathe's kernels cannot run here. The NumPy references, the CPU tests and the "
            "reference decode path still run. On an NVIDIA machine install with `pip install -e "
            "'.[cuda]'`; on Apple silicon with `pip install -e .`."
        )


@functools.cache
def backend() -> str:
    """'metal', 'cuda' or 'cpu' (no GPU backend)."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def has_gpu() -> bool:
    return backend() != "cpu"


def require_gpu() -> None:
    if not has_gpu():
        raise NoGpuBackend()


@functools.cache
def device_name() -> str:
    """Human name of the device kernels run on, e.g. 'NVIDIA H200'; 'cpu' without a GPU."""
    if not has_gpu():
        return "cpu"
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return str(info.get("device_name") or info.get("architecture") or backend())


# ---- inputs that live on the device ---------------------------------------------------------------
# On CUDA, MLX keeps an array made from host data (mx.array(numpy), mx.array([3])) in managed
# memory written by the host; a kernel that reads it then waits on page migration or on remote
# reads over PCIe, every time the host has touched the page. Outputs of GPU ops are allocated on
# the device; copying weights and kernel constants there cut a decode token by a third
# (kernels/loop/NOTES.md, "Kernel inputs resident on the device"). So every constant a kernel
# reads comes from here.
def resident(a: mx.array) -> mx.array:
    """A copy of `a` made by a GPU op (an add of zero) and evaluated: device memory on CUDA."""
    out = a + mx.zeros((), a.dtype)
    mx.eval(out)
    return out


# MLX's CUDA allocator serves arrays of at most 8 bytes from one small managed pool (advised
# read-mostly) that also holds MLX's own scalars, such as the token id the host reads back every
# step. A kernel constant of one or two values would live there too: PAD_CONSTANTS keeps each in
# a buffer of its own (a view of the first values of a 16-byte array). The pad_constants option
# turns it off, for the comparison.


def constant(values: tuple, dtype: mx.Dtype = mx.int32) -> mx.array:
    """A small constant input (dims, eps, scale) as a resident array, made once per value. Not
    for values that change every token: making one waits for the GPU (see `index`)."""
    return _constant(values, dtype, options.get("pad_constants"))


def table_constant(values) -> mx.array:
    """`constant` for host int32 values in an array (a block table, a batch's lengths): cached on
    their bytes, so that a long table costs a copy and a hash rather than a Python int an entry
    (a 2048-entry table took 250 us a call through `constant`'s tuple key)."""
    a = np.ascontiguousarray(values, dtype=np.int32)
    if a.nbytes < 16:  # small: as every constant (padded where pad_constants says)
        return constant(tuple(int(x) for x in a.reshape(-1))).reshape(a.shape)
    return _table_constant(a.tobytes(), a.shape)


@functools.lru_cache(maxsize=256)
def _table_constant(raw: bytes, shape: tuple[int, ...]) -> mx.array:
    return resident(mx.array(np.frombuffer(raw, np.int32).reshape(shape)))


@functools.lru_cache(maxsize=4096)
def _constant(values: tuple, dtype: mx.Dtype, pad: bool) -> mx.array:
    if not pad:
        return resident(mx.array(values, dtype=dtype))
    width = max(len(values), -(-16 // dtype.size))
    held = resident(mx.array(tuple(values) + (0,) * (width - len(values)), dtype=dtype))
    view = held[: len(values)]
    mx.eval(view)
    return view


_INDEX_FROM = 4096  # entries of the first index table; it doubles as needed


@functools.lru_cache(maxsize=32)
def _indices(n: int) -> mx.array:
    return resident(mx.arange(n, dtype=mx.int32))


def index(i: int) -> mx.array:
    """int32[1] holding i, as a view into a resident table 0, 1, 2, ...: the per-token values
    (position, length, slot, token id) cost neither a host write into managed memory nor a
    wait for the GPU (only growing the table waits, at most once per doubling)."""
    if i < 0:
        raise ValueError(f"index must be >= 0, got {i}")
    n = _INDEX_FROM
    while n <= i:
        n *= 2
    return _indices(n)[i: i + 1]


# On CUDA, compiled modules are kept on disk across processes (kernels.jit_cache); MLX reads where
# they go once, before it compiles anything, so that is set up here, at import.
_CUDA = [backend() == "cuda" and jit_cache.activate() is not None]


@functools.cache
def _header(cuda: bool | None = None) -> str:
    shared = (MSL_DIR / "lathe.h").read_text()
    if backend() == "cuda" if cuda is None else cuda:
        return (MSL_DIR / "cuda_compat.h").read_text() + "\n" + shared
    return shared


_INCLUDE = re.compile(r'^[ \t]*#include "([^"]+)"[ \t]*$', re.MULTILINE)


@functools.cache
def read_body(path: str) -> str:
    """An MSL body by path relative to kernels/, e.g. 'rope/rope.metal'. A line
    `#include "family/part.metal"` is replaced by that file (itself read this way): MLX compiles
    a source string, not files, so the parts that several bodies share are pasted in here."""
    text = (KERNEL_ROOT / path).read_text()
    return _INCLUDE.sub(lambda m: read_body(m.group(1)).rstrip("\n"), text)


@dataclass(frozen=True)
class KernelSpec:
    """What MLX needs to build one kernel object: a unique name, the body and its I/O names.

    ``prelude`` is MSL pasted before the body (used for the two cache-write forms, which differ
    only in where the rows go); it is part of the kernel's identity, so it is part of the name.
    """

    name: str
    body: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    prelude: str = ""
    ensure_row_contiguous: bool = True
    # The threadgroup memory a launch declares, in bytes, from its constants (None: the body
    # declares none). check_launch holds it to the target's budget before the launch; `lathe
    # compile --metal` and tests/test_metal_front_end.py hold it to what the source declares.
    threadgroup_bytes: Callable[[Mapping[str, Any]], int] | None = field(default=None, compare=False)
    # The inputs the body writes through (`writable(name)`, the caches), as the builder knows them:
    # a source's text over-counts (decode attention writes its caches only where it rotates K, an
    # `#if` away), and a check of an input it does not write costs a wait
    # (tests/test_metal_front_end.py holds each list to clang's AST of the compiled code)
    in_place: tuple[str, ...] = ()
    # (threads, threadgroups): on CUDA the kernel is declared __launch_bounds__(threads,
    # threadgroups), so the compiler keeps its registers to what that many threadgroups of that
    # many threads an SM leave (spilling if it must); None: the compiler's own choice
    launch_bounds: tuple[int, int] | None = None

    def source(self) -> str:
        return self.prelude + "\n" + read_body(self.body)

    @functools.cached_property
    def written_in_place(self) -> tuple[int, ...]:
        """The positions of the inputs in `in_place`, which launches check (check_in_place_targets)."""
        return tuple(self.inputs.index(n) for n in self.in_place)


# MLX's CUDA backend hashes a custom kernel's whole source at every launch: CustomKernel::eval_gpu
# (0.32.4) names the kernel's compiled module by std::hash of the generated source, header
# included, each time it encodes the kernel. Our header and a seam's body came to ~50 KB a launch,
# 4 MB a Llama token, and the hashing to ~30% of the host's time per token (py-spy of the
# compiled-pipelined loop, harness.tools.host_profile). So on CUDA the header and the body MLX holds are
# one `#include` line each, of a file named by its content's digest that NVRTC reads when MLX
# compiles the kernel (the body's file is pasted inside the kernel function, as the text would be).
# The inline_source option hands MLX the text itself, for the comparison.
SOURCE_DIR = Path(os.environ.get("LATHE_SOURCE_DIR") or
                  Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lathe" / "sources")


def include_line(text: str, suffix: str, directory: Path | None = None) -> str:
    """`#include "<dir>/<digest><suffix>"` of a file holding `text`, written once (atomically: a
    concurrent process writes the same bytes under the same name)."""
    directory = SOURCE_DIR if directory is None else directory
    path = directory / f"{hashlib.sha1(text.encode()).hexdigest()[:20]}{suffix}"
    if not path.exists() or path.read_text() != text:
        directory.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        part.write_text(text)
        os.replace(part, path)
    return f'#include "{path}"\n'


def cuda_sources(source: str, header: str) -> tuple[str, str]:
    """(source, header) as MLX's CUDA backend gets them: include lines (above), or the text itself
    with the inline_source option. `lathe compile` compiles the same."""
    if options.get("inline_source"):
        return source, header
    return include_line(source, ".body.cuh"), include_line(header, ".header.cuh")


@functools.cache
def handed_sources(spec: KernelSpec, inline: bool, cuda: bool | None = None) -> tuple[str, str]:
    """(source, header) exactly as MLX gets them for `spec`, once per process and source form;
    `cuda` (default: the backend's) asks for the CUDA form on any machine (`lathe compile`)."""
    cuda = backend() == "cuda" if cuda is None else cuda
    source, header = spec.source(), _header(cuda)
    if cuda:
        if spec.launch_bounds:
            header += bounds_lines(*spec.launch_bounds)
        source, header = cuda_sources(source, header)
    return source, header


def bounds_lines(threads: int, groups: int) -> str:
    """Header lines that declare the one __global__ function after them (MLX's kernel, whose name
    the header cannot know: it carries the launch's template constants) __launch_bounds__(threads,
    groups): `__global__` is CUDA's macro for __location__(global), redefined with the bounds."""
    if threads < 1 or groups < 1:
        raise ValueError(f"launch bounds of {threads} threads and {groups} threadgroups an SM")
    return f"\n#undef __global__\n#define __global__ __location__(global) __launch_bounds__({threads}, {groups})\n"


def compile_kernel(spec: KernelSpec) -> Any:
    """The MLX kernel object for `spec` (built once per process and source form; see module
    docstring)."""
    return _compile_kernel(spec, options.get("inline_source"))


@functools.cache
def _compile_kernel(spec: KernelSpec, inline: bool) -> Any:
    require_gpu()
    source, header = handed_sources(spec, inline)
    common = dict(
        name=spec.name,
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=source,
        header=header,
        ensure_row_contiguous=spec.ensure_row_contiguous,
    )
    if backend() == "metal":
        return mx.fast.metal_kernel(**common)
    return mx.fast.cuda_kernel(**common)


@dataclass
class Launch:
    """One launch: inputs in the spec's order, outputs as (shape, dtype), geometry in threads."""

    spec: KernelSpec
    inputs: Sequence[mx.array]
    outputs: Sequence[tuple[tuple[int, ...], Any]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    constants: dict[str, Any] = field(default_factory=dict)


# Checks set this to NaN so that an element a kernel forgot to write fails the comparison.
_poison: list[float | None] = [None]


def poison_value() -> float | None:
    """What launches fill their outputs with first (NaN inside poisoned_outputs, else None)."""
    return _poison[0]


class poisoned_outputs:
    """Context manager: every launch inside fills its outputs with `value` (NaN) first."""

    def __init__(self, value: float = float("nan")) -> None:
        self.value = value

    def __enter__(self) -> "poisoned_outputs":
        self._saved = _poison[0]
        _poison[0] = self.value
        return self

    def __exit__(self, *exc: object) -> None:
        _poison[0] = self._saved


@functools.cache
def ptx_kernel(spec: KernelSpec, constants: tuple, inputs: tuple, outputs: tuple) -> tuple[str, bytes]:
    """(symbol, PTX) of one instantiation: inputs and outputs as dtype names. The translation unit
    is MLX's (kernels.jit_cache) with the kernel extern "C", so that its symbol is its name; the
    name carries a hash of everything that shapes the code, so no two share a module."""
    from kernels import ptx

    require_gpu()
    source = spec.source()
    digest = hashlib.sha1(repr((source, constants, inputs, outputs)).encode()).hexdigest()[:10]
    inst = jit_cache.Instance(f"{spec.name}_{digest}", source, _header(True),
                              tuple((n, d, 1) for n, d in zip(spec.inputs, inputs)),
                              tuple(zip(spec.outputs, outputs)), tuple(constants))
    unit = inst.mlx_source().replace("__global__ void", 'extern "C" __global__ void', 1)
    return inst.kernel_name, ptx.compile_ptx(unit, inst.kernel_name)


def instance(job: Launch, inline: bool | None = None, cuda: bool | None = None) -> jit_cache.Instance:
    """The module MLX's CUDA backend compiles for `job` (kernels.jit_cache)."""
    inline = options.get("inline_source") if inline is None else inline
    source, header = handed_sources(job.spec, inline, cuda)
    return jit_cache.Instance(
        job.spec.name, source, header,
        tuple((n, jit_cache.dtype_name(a.dtype), a.ndim) for n, a in zip(job.spec.inputs, job.inputs)),
        tuple((n, jit_cache.dtype_name(d)) for n, (_, d) in zip(job.spec.outputs, job.outputs)),
        tuple(job.constants.items()))


_seen: set = set()  # launches whose module is in the on-disk cache (or left to MLX)
_checked: set = set()  # off CUDA: launches whose limits were checked (check_launch)


class recording:
    """Context manager: launches inside are recorded (`.jobs`), not run; each returns zeros of its
    output shapes, lazily (nothing reaches the GPU unless evaluated). For compiling ahead
    (`prepare`) and for `lathe compile`. `target` ("metal" or "cuda"): the backend the launches
    are made for (target_backend) on a machine without a GPU; `lathe compile --metal` records
    Metal's. `keep_prepared`: what code inside hands to prepare() is kept in `.prepared` rather
    than compiled (`lathe compile --record`, `pytest --record-launches`: a decoder prepares its
    token's kernels when it is built, where a test may stop before launching them), and native
    launches are noted in `.native` (kernels.native.prepare's keys) rather than compiled."""

    def __init__(self, target: str | None = None, keep_prepared: bool = False) -> None:
        if target not in (None, "metal", "cuda"):
            raise ValueError(f"target must be 'metal' or 'cuda', got {target!r}")
        self.target, self.keep_prepared = target, keep_prepared

    def __enter__(self) -> "recording":
        self.jobs: list[Launch] = []
        self.prepared: list[Launch] = []
        self.native: list[tuple] = []
        self._saved = _recorder[0], _target[0], _prepared_sink[0], _native_sink[0]
        _recorder[0] = self.jobs
        _target[0] = self.target or _target[0]
        if self.keep_prepared:
            _prepared_sink[0], _native_sink[0] = self.prepared, self.native
        return self

    def __exit__(self, *exc: object) -> None:
        _recorder[0], _target[0], _prepared_sink[0], _native_sink[0] = self._saved


_recorder: list[list | None] = [None]


def recording_launches() -> bool:
    """Whether launches are being recorded (a `recording` is open), not run."""
    return _recorder[0] is not None


_prepared_sink: list[list | None] = [None]
_native_sink: list[list | None] = [None]
_target: list[str | None] = [None]


def native_sink() -> list | None:
    """Inside a recording(keep_prepared=True): the list native launches note themselves in."""
    return _native_sink[0]


def target_backend() -> str:
    """The backend launches are made for: the device's, or while launches are recorded on a
    machine without a GPU, the recording's target (default CUDA: `lathe compile` builds CUDA
    modules there, kernels.ptx)."""
    if backend() == "cpu" and _recorder[0] is not None:
        return _target[0] or "cuda"
    return backend()


def prepare(jobs: Sequence[Launch]) -> tuple[int, dict[str, str]]:
    """Compile, in parallel, the modules of recorded launches that the on-disk cache lacks (CUDA;
    nothing elsewhere). Returns how many were compiled and the NVRTC log of each failure. Inside a
    recording(keep_prepared=True) they go to its `.prepared` instead, for whoever reads the
    recording to compile (a decoder prepares its token's kernels ahead of any launch)."""
    if _prepared_sink[0] is not None:
        _prepared_sink[0].extend(jobs)
        return 0, {}
    if not _CUDA[0]:
        return 0, {}
    return jit_cache.prepare([instance(j) for j in jobs])


_fits: dict = {}


def sm_count() -> int | None:
    """The GPU's streaming multiprocessors, where a launch can be sized by them: None off CUDA and
    while recording (a recording must not depend on the machine that makes it)."""
    if not _CUDA[0] or _recorder[0] is not None:
        return None
    return jit_cache.sm_count()


def _module_key(job: Launch, inline: bool) -> tuple:
    """A launch's module, cheaply: its spec, constants and source form. It leaves out the dtypes,
    which cost more than the rest to read (harness/NOTES.md): a second dtype under one spec and
    constants is taken for the first."""
    return id(job.spec), tuple(job.constants.values()), inline


def resident_groups(job: Launch) -> int | None:
    """Threadgroups of `job` that the GPU holds at once, from its compiled module's registers and
    threadgroup memory (kernels.jit_cache.resident); None off CUDA, while recording, or where the
    driver cannot say. Kept per spec and constants, as launch() keeps its cache check."""
    if not _CUDA[0] or _recorder[0] is not None:
        return None
    threads = job.threadgroup[0] * job.threadgroup[1] * job.threadgroup[2]
    key = (*_module_key(job, options.get("inline_source")), threads)
    if key not in _fits:
        _fits[key] = jit_cache.resident(instance(job), threads)
    return _fits[key]


# Each target's limits on a launch (kernels.backends makes its choices from them): threads a
# threadgroup, where lathe keeps its Metal launches within 256 (a pipeline may cap them below
# 1024) until a Metal run measures otherwise; and the static threadgroup memory a threadgroup may
# declare, 48 KiB on CUDA, 32 KiB on Apple GPUs
THREADS_PER_THREADGROUP = {"cuda": 1024, "metal": 256}
THREADGROUP_MEMORY = {"cuda": 48 * 1024, "metal": 32 * 1024}


class LaunchLimitError(ValueError):
    """A launch past its target's limits, refused before it is made or recorded."""


def check_launch(job: Launch) -> None:
    """Refuse, with the numbers, a launch whose threadgroups hold more threads or declare more
    threadgroup memory (its spec's threadgroup_bytes) than its target allows: on CUDA the
    compile or the launch would fail with less to go on, and on Metal MLX would throw at the
    pipeline or the library. Wrappers that can size their launch (the GEMVs' staged X, the tiled
    prefill's key tiles, decode attention's query split) pick a configuration that fits first."""
    target = "metal" if target_backend() == "metal" else "cuda"
    threads = job.threadgroup[0] * job.threadgroup[1] * job.threadgroup[2]
    if threads > THREADS_PER_THREADGROUP[target]:
        raise LaunchLimitError(f"{job.spec.name}: threadgroups of {threads} threads, past the "
                               f"{THREADS_PER_THREADGROUP[target]} that lathe's {target} launches may have")
    if target == "cuda" and job.spec.launch_bounds and threads > job.spec.launch_bounds[0]:
        raise LaunchLimitError(f"{job.spec.name}: threadgroups of {threads} threads, past its launch bounds' "
                               f"{job.spec.launch_bounds[0]}")
    formula = job.spec.threadgroup_bytes
    if formula is not None:
        need, budget = formula(job.constants), THREADGROUP_MEMORY[target]
        if need > budget:
            raise LaunchLimitError(f"{job.spec.name} with {dict(job.constants)}: {need} bytes of threadgroup "
                                   f"memory, past the {budget} a {target} threadgroup may declare")


# ---- inputs written in place ---------------------------------------------------------------------
# A body that writes through an input (`writable(name)`: the KV caches) writes into the buffer MLX
# binds for it. MLX copies an input that is not row-contiguous before binding it
# (ensure_row_contiguous, on both backends), so a write through a transposed or strided view
# would land in the copy and be lost, silently (kernels/msl/NOTES.md). MLX's Python arrays show
# no strides but through the buffer protocol, which evaluates the array, so each array is
# checked once: one the check passed, or that `depends` or `reshaped` made from one, is known
# whole from then on (by identity, weakly held), and a decode loop's caches are checked at their
# first write only.
_whole: dict[int, weakref.ref] = {}


def _known_whole(a: mx.array) -> bool:
    ref = _whole.get(id(a))
    return ref is not None and ref() is a


def _mark_whole(a: mx.array) -> None:
    key = id(a)
    _whole[key] = weakref.ref(a, lambda _, key=key: _whole.pop(key, None))


def require_whole(a: mx.array, what: str) -> None:
    """Refuse an array to be written in place that is not row-contiguous."""
    if _known_whole(a):
        return
    try:
        view = memoryview(a)  # evaluates a
    except RuntimeError:
        # inside mx.compile's trace the inputs are placeholders, which cannot be evaluated; the
        # arrays the compiled function is called with are the decoder's own caches
        return
    if not view.c_contiguous:
        raise ValueError(f"{what} is written in place, so it must be a row-contiguous array (not a transposed "
                         f"or strided view, shape {tuple(a.shape)}): MLX would bind a copy of it and the write "
                         "would be lost")
    _mark_whole(a)


def check_in_place_targets(job: Launch) -> None:
    """Refuse a launch that would write through an input that is not row-contiguous."""
    for i in job.spec.written_in_place:
        require_whole(job.inputs[i], f"{job.spec.name}: {job.spec.inputs[i]}")


def depends(arrays: mx.array | list[mx.array], dependencies: list[mx.array]) -> Any:
    """mx.depends(arrays, dependencies), whose results share their inputs' buffers: each result of
    an input known whole is known whole (the caches a kernel wrote in place, passed on)."""
    out = mx.depends(arrays, dependencies)
    for a, o in zip(arrays, out) if isinstance(arrays, list) else ((arrays, out),):
        if _known_whole(a):
            _mark_whole(o)
    return out


def reshaped(a: mx.array, shape: tuple[int, ...], what: str) -> mx.array:
    """a.reshape(shape) of an array to be written in place: `a` is checked (require_whole), and
    the reshape, a view of the same buffer, is known whole with it."""
    require_whole(a, what)
    out = a.reshape(shape)
    if _known_whole(a):
        _mark_whole(out)
    return out


def layer_views(stack: mx.array, what: str) -> list[mx.array]:
    """Layer i's rows of a stack of caches to be written in place (every layer's K in one array),
    for each i: `stack` is checked (require_whole), and each view, a slice of its first axis that
    shares its buffer, is known whole with it, so writing through one checks nothing more (a
    check would evaluate the stack: a wait a layer). A slice, reshaped: MLX's `stack[i]` is a
    gather, a copy, and a kernel's writes into a copy never reach the stack."""
    require_whole(stack, what)
    views = [stack[i:i + 1].reshape(stack.shape[1:]) for i in range(stack.shape[0])]
    if _known_whole(stack):
        for view in views:
            _mark_whole(view)
    return views


def launch(job: Launch) -> list[mx.array]:
    if len(job.inputs) != len(job.spec.inputs):
        raise ValueError(f"{job.spec.name}: {len(job.inputs)} inputs for {job.spec.inputs}")
    if job.spec.written_in_place:
        check_in_place_targets(job)
    if _recorder[0] is not None:
        check_launch(job)
        _recorder[0].append(job)
        return [mx.zeros(tuple(s), d) for s, d in job.outputs]
    inline = options.get("inline_source")
    kernel = _compile_kernel(job.spec, inline)
    if _CUDA[0]:
        # The first launch of an instantiation in this process: its limits are checked, and MLX
        # is about to compile it unless the on-disk cache has it; if not, compile it there first
        # (a second dtype under one key is compiled by MLX, as before). Checked once, not at each
        # launch of the decode loop (the host's time a launch is what small models decode at).
        key = _module_key(job, inline)
        if key not in _seen:
            check_launch(job)
            jit_cache.ensure(instance(job, inline))
            _seen.add(key)
    else:
        key = (*_module_key(job, inline), job.threadgroup)
        if key not in _checked:
            check_launch(job)
            _checked.add(key)
    return kernel(
        inputs=list(job.inputs),
        template=list(job.constants.items()),
        grid=job.grid,
        threadgroup=job.threadgroup,
        output_shapes=[tuple(s) for s, _ in job.outputs],
        output_dtypes=[d for _, d in job.outputs],
        init_value=_poison[0],
    )


# ---- the two forms of a cache write (DESIGN.md "Writing into persistent buffers") ---------------
FORMS = ("functional", "in_place")


def cache_prelude(form: str, caches: Sequence[str]) -> str:
    """Where a cache-writing body puts its rows.

    The body writes token t of kv head h to ``<c>_dst[((h * dst_rows) + dst_row0 + t) * D + e]``.
    functional: ``<c>_dst`` is a fresh output ``<c>_rows[h, t, e]`` (dst_row0 = 0) that the caller
    slice-updates into the cache. in_place: ``<c>_dst`` is the cache input itself at row
    ``pos[0] + t``, and thread 0 writes the ordering token ``written``.
    """
    if form == "functional":
        lines = [f"auto {c}_dst = {c}_rows;" for c in caches]
        lines.append("const uint dst_row0 = 0;")
    elif form == "in_place":
        lines = [f"auto {c}_dst = writable({c}_cache);" for c in caches]
        lines.append("const uint dst_row0 = uint(pos[0]);")
        lines.append(
            "if (thread_position_in_grid.x == 0 && thread_position_in_grid.y == 0 && "
            "thread_position_in_grid.z == 0) { written[0] = 1u; }"
        )
    else:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return "\n".join(lines)


def cache_io(form: str, caches: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Extra (inputs, outputs) names of a cache-writing kernel in `form`."""
    if form == "functional":
        return (), tuple(f"{c}_rows" for c in caches)
    return tuple(f"{c}_cache" for c in caches), ("written",)
