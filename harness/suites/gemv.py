"""The quantized GEMV family (Q4_0, Q8_0): correctness against float64 on dequantized weights,
the formats against the gguf package, and M = 1 benchmarks against MLX's fp16 matvec and
quantized_matmul. So far: v1 kernels, M = 1..4 (issue 3 has the rest)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pandas as pd

from harness.bench import BenchCase
from harness.check import CheckCase, Comparison, compare, exact
from reference.quant import dequantize, quantize, storage_bytes

TOL = 2e-3
QTYPES = ("q4_0", "q8_0")
SMALL_N = (1, 7, 33, 4097)
SMALL_K = (32, 96, 4128)
# Real shapes (N x K); the vocabulary-sized ones (151936 x 1024, 128256 x 4096) are left to the
# batched/v2 work: their host-side quantization and float64 reference dominate a check run.
REAL = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (3072, 1024), (1024, 3072))


def _weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    # Rows of different scales, as in real layers; float32 (quantize converts exactly).
    return (rng.standard_normal((n, k), dtype=np.float32)
            * rng.uniform(0.02, 0.2, (n, 1)).astype(np.float32))


def _gemv_case(qtype: str, m: int, n: int, k: int) -> CheckCase:
    from kernels.gemv import gemv_v1
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        blocks = quantize(_weights(rng, n, k), qtype)
        x = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
        with poisoned_outputs():
            y = gemv_v1(mx.array(x), mx.array(blocks), qtype, n, k)
            mx.eval(y)
        want = x.astype(np.float64) @ dequantize(blocks, qtype, k).astype(np.float64).T
        return [compare("y", np.array(y), want, TOL)]

    return CheckCase("gemv", f"gemv_{qtype}", "v1", dict(M=m, N=n, K=k), run)


def check_cases(small: bool = False) -> list[CheckCase]:
    """Both formats over odd small shapes and real ones, M cycling through 1..4 (`small`: the
    odd shapes only, for `lathe compile`)."""
    cases = []
    for qtype in QTYPES:
        shapes = [(n, k) for n in SMALL_N for k in SMALL_K] + ([] if small else list(REAL))
        for c, (n, k) in enumerate(shapes):
            cases.append(_gemv_case(qtype, 1 + c % 4, n, k))
    return cases


def _vs_gguf(qtype: str) -> CheckCase:
    def run(rng: np.random.Generator) -> list[Comparison]:
        from gguf import GGMLQuantizationType as T
        from gguf import quants

        w = _weights(rng, 33, 4128)
        gtype = {"q4_0": T.Q4_0, "q8_0": T.Q8_0}[qtype]
        ours, theirs = quantize(w, qtype), quants.quantize(w, gtype).reshape(33, -1)
        return [exact("quantized bytes", ours, theirs),
                exact("dequantized", dequantize(ours, qtype, 4128),
                      quants.dequantize(theirs, gtype).reshape(w.shape))]

    return CheckCase("gemv", f"reference.quantize_{qtype}", "vs gguf.quants", dict(N=33, K=4128),
                     run, needs_gpu=False)


def reference_cases() -> list[CheckCase]:
    return [_vs_gguf(q) for q in QTYPES]


# ---- benchmarks ------------------------------------------------------------------------------
BENCH_SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))


def _bench_ours(qtype: str, n: int, k: int) -> BenchCase:
    from kernels.gemv import gemv_v1

    blocks = None

    def make():
        nonlocal blocks
        if blocks is None:  # quantize once on the host; every set is its own device copy
            blocks = mx.array(quantize(_weights(np.random.default_rng(0), n, k), qtype))
        return {"w": blocks + mx.array(0, mx.uint8), "x": mx.random.normal((1, k)).astype(mx.float16)}

    nbytes = storage_bytes(qtype, n, k) + 2 * k + 2 * n
    return BenchCase("gemv", "gemv-m1", f"gemv_{qtype}", "v1", dict(M=1, N=n, K=k), make,
                     lambda s: [gemv_v1(s["x"], s["w"], qtype, n, k)], nbytes, 2 * n * k, nbytes)


def _bench_mlx(kind: str, n: int, k: int) -> BenchCase:
    def make():
        w = (mx.random.normal((n, k)) * 0.05).astype(mx.float16)
        state = {"x": mx.random.normal((1, k)).astype(mx.float16)}
        if kind == "fp16":
            state["w"] = w
        else:
            state["wq"], state["scales"], state["biases"] = mx.quantize(w, group_size=32, bits=int(kind[0]))
        return state

    if kind == "fp16":
        kernel, nbytes = "mlx.matmul-fp16", 2 * n * k
        step = lambda s: [s["x"] @ s["w"].T]  # noqa: E731
    else:
        bits = int(kind[0])
        kernel, nbytes = "mlx.quantized_matmul", n * k * bits // 8 + n * (k // 32) * 4
        step = lambda s: [mx.quantized_matmul(s["x"], s["wq"], s["scales"], s["biases"],  # noqa: E731
                                              transpose=True, group_size=32, bits=bits)]
    nbytes += 2 * k + 2 * n
    return BenchCase("gemv", "gemv-m1", kernel, kind, dict(M=1, N=n, K=k), make, step, nbytes,
                     2 * n * k, nbytes)


def bench_cases(quick: bool = False) -> list[BenchCase]:
    cases = []
    for n, k in BENCH_SHAPES[:2] if quick else BENCH_SHAPES:
        cases += [_bench_ours(q, n, k) for q in QTYPES]
        cases += [_bench_mlx(kind, n, k) for kind in ("fp16", "4bit-gs32", "8bit-gs32")]
    return cases


def plots(df: pd.DataFrame, out_dir: Path, peak_gbs: float) -> list[Path]:
    from harness.plots import bandwidth_plot

    return [bandwidth_plot(df[df.benchmark == "gemv-m1"], "bytes", out_dir / "gemv-m1.png",
                           "GEMV M=1: GB/s against bytes moved", peak_gbs=peak_gbs,
                           x_label="bytes moved per call (weights + x + y)")]
