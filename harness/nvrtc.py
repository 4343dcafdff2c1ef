"""Compile every kernel instantiation for CUDA without a GPU: `lathe compile [family]`.

Device time is scarce; a body that does not compile on NVRTC should fail here, not there. The
family's check cases are run with `kernels.runtime.launch` replaced by a recorder (outputs are
zeros, comparisons are ignored), which collects each distinct kernel instantiation: its source,
its input and output dtypes and its template constants. Each is then wrapped the way MLX's CUDA
backend wraps a custom kernel (its default header, our header, a generated `__global__`
signature, constants as `constexpr`; header and body as the include lines the runtime hands MLX)
and compiled with NVRTC for sm_90.

Needs NVRTC (libnvrtc.so, e.g. from the nvidia-cuda-nvrtc wheel; set LATHE_NVRTC to its path) and
the CUDA headers (cuda_fp16.h and CCCL's cuda/std; set LATHE_CUDA_INCLUDE, default
/usr/local/cuda/include). MLX's own device header is replaced by a stub holding what the
generated code uses. This checks compilation only; the device run checks results.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import ptx


@dataclass(frozen=True)
class Instantiation:
    name: str
    source: str
    inputs: tuple[tuple[str, str], ...]  # (name, dtype)
    outputs: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, object], ...]

    def cuda_source(self, header: str) -> str:
        """The translation unit MLX compiles: the body and header handed over as the runtime hands
        them (kernels.runtime.cuda_sources: include lines of their text, by default)."""
        from kernels.runtime import cuda_sources

        source, header = cuda_sources(self.source, header)
        return ptx.cuda_source(self.name, source, header, self.inputs, self.outputs, self.constants)


def record_instantiations(cases) -> list[Instantiation]:
    """Run the cases with launches recorded instead of executed."""
    import mlx.core as mx

    import kernels.runtime as rt

    seen: dict[tuple, Instantiation] = {}

    def recorder(job):
        dtype = ptx.dtype_name
        inst = Instantiation(
            name=ptx.kernel_name(job.spec.name, job.constants),
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


def compile_all(instantiations: list[Instantiation], arch: str = "compute_90") -> list[tuple[str, str]]:
    """NVRTC-compile each instantiation; returns (name, log) for every failure."""
    from kernels.runtime import MSL_DIR

    ptx.nvrtc(), ptx.include_dirs()  # FileNotFoundError here, before any compilation
    header = (MSL_DIR / "cuda_compat.h").read_text() + "\n" + (MSL_DIR / "lathe.h").read_text()
    failures = []
    for inst in instantiations:
        try:
            ptx.compile_ptx(inst.cuda_source(header), inst.name, arch)
        except ptx.CompileError as exc:
            failures.append((inst.name, str(exc)))
    return failures
