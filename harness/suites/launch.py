"""The cost of a call that does nothing: a one-thread custom kernel (lathe's copy16 of 16 bytes)
against MLX built-ins on a handful of values, each timed like every benchmark (K calls in one
evaluation). The difference is the per-call floor of MLX's custom-kernel path, which bounds
every small lathe kernel (kernels/gemv/NOTES.md); `chain` runs 8 calls that depend on each other
per step, to see whether the floor adds up call by call. Two more ways to call the same kernel
separate the costs: MLX's kernel object called directly (no lathe wrapper: what is left is
MLX's), and the PTX path (compiled once by NVRTC, `mx.fast.precompiled_cuda_kernel`: MLX no
longer rebuilds the source string per call), when NVRTC and the CUDA headers are found."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from harness.bench import BenchCase
from harness.check import CheckCase, Comparison, exact


def check_cases(small: bool = False) -> list[CheckCase]:
    from kernels.bandwidth import copy16
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        a = rng.integers(0, 2**32, 4, dtype=np.uint64).astype(np.uint32)
        with poisoned_outputs(0):
            out = copy16(mx.array(a))
            mx.eval(out)
        return [exact("16 bytes copied", np.array(out), a)]

    return [CheckCase("launch", "copy16", "one thread", dict(n=4), run)]


def reference_cases() -> list[CheckCase]:
    return []


def bench_cases(quick: bool = False) -> list[BenchCase]:
    from kernels.bandwidth import copy16

    def make():
        return {"u": mx.arange(4, dtype=mx.uint32), "h": mx.ones((1, 8), mx.float16),
                "g": mx.ones((8,), mx.float16)}

    def chain(fn, n=8):
        def step(s):
            x = s
            for _ in range(n):
                x = fn(x)
            return [x]
        return step

    import kernels.runtime as rt
    from kernels.bandwidth import _COPY

    one = dict(grid=(1, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(4,)],
               output_dtypes=[mx.uint32])

    def direct(u):  # the kernel object MLX made, called with the arguments prepared once
        return rt.compile_kernel(_COPY)(inputs=[u, dims], template=[], **one)[0]

    def precompiled(u):
        return mx.fast.precompiled_cuda_kernel(name=ptx_name, compiled_source=ptx_code,
                                               inputs=[u, dims], scalars=[], **one)[0]

    dims = mx.array([1], dtype=mx.int32)
    cases = [
        ("lathe copy16 (custom kernel)", "single", lambda s: [copy16(s["u"])]),
        ("copy16: MLX kernel object, no wrapper", "single", lambda s: [direct(s["u"])]),
        ("mx.add", "single", lambda s: [s["u"] + 1]),
        ("mx.fast.rms_norm", "single", lambda s: [mx.fast.rms_norm(s["h"], s["g"], 1e-5)]),
        ("lathe copy16 (custom kernel)", "chain of 8", lambda s: chain(copy16)(s["u"])),
        ("copy16: MLX kernel object, no wrapper", "chain of 8", lambda s: chain(direct)(s["u"])),
        ("mx.add", "chain of 8", lambda s: chain(lambda x: x + 1)(s["u"])),
    ]
    try:
        ptx_name, ptx_code = rt.ptx_kernel(_COPY, (), ("uint32", "int32"), ("uint32",))
        cases += [("copy16: PTX, precompiled_cuda_kernel", "single", lambda s: [precompiled(s["u"])]),
                  ("copy16: PTX, precompiled_cuda_kernel", "chain of 8",
                   lambda s: chain(precompiled)(s["u"]))]
    except (FileNotFoundError, OSError) as exc:
        print(f"launch: no PTX cases ({exc})")
    return [BenchCase("launch", "launch-floor", kernel, variant, dict(n=4), make, step, 16, 0, 16)
            for kernel, variant, step in cases]
