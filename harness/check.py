"""Correctness checks: one row per kernel and shape, compared against the float64 references.

A family's suite (harness/suites/<family>.py) yields `CheckCase`s; each runs its kernel on fresh
random inputs with outputs poisoned (NaN) and returns its comparisons. `lathe check` prints one
row per case; the GPU tests run the same cases under pytest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from reference import rel_err


@dataclass
class Comparison:
    """One output against its reference: rel_err within tol, or an exact condition."""

    what: str
    rel_err: float
    tol: float

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.rel_err) and self.rel_err <= self.tol)


def compare(what: str, out: Any, ref: Any, tol: float) -> Comparison:
    return Comparison(what, rel_err(np.asarray(out), np.asarray(ref)), tol)


def compare_products(what: str, out: Any, ref: Any, x: np.ndarray, w: np.ndarray, tol: float) -> Comparison:
    """out = x @ w.T ([M, N]) against its float64 ref, in norm relative to the larger of ||ref||
    and the size the products have: ||x_m|| ||w_n|| / sqrt(K), in square summed over (m, n). With
    few outputs (a GEMV of one row), a dot product that cancels to a small part of its terms
    leaves the kernel's rounding of X' (made at the terms' scale) large against ||ref||, and a
    plain relative error fails a right kernel now and then; against the floor, an output wrong by
    tol of a product's size still fails. NaN anywhere fails."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    if not np.all(np.isfinite(out)):
        return Comparison(what, float("inf"), tol)
    size = np.linalg.norm(np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(w, axis=1))) / np.sqrt(x.shape[1])
    denom = max(float(np.linalg.norm(ref)), float(size))
    return Comparison(what, float(np.linalg.norm(out - ref)) / (denom if denom > 0 else 1.0), tol)


def exact(what: str, out: Any, expected: Any) -> Comparison:
    """Bitwise equality (e.g. cache rows a kernel must not touch): rel_err 0 or inf."""
    same = np.array_equal(np.asarray(out), np.asarray(expected), equal_nan=False)
    return Comparison(what, 0.0 if same else float("inf"), 0.0)


def within_fp16_steps(what: str, out: Any, ref: Any, steps: float = 1.0) -> Comparison:
    """fp16 output against a float32 reference, in units of the reference's fp16 spacing: for
    values a GPU may round once where the reference rounds twice (a product fused into a
    difference, d * sc * q - dmin * m), at most `steps` of them; NaN anywhere fails."""
    ref = np.asarray(ref, dtype=np.float32)
    spacing = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float32)
    worst = (np.abs(np.asarray(out).astype(np.float32) - ref) / spacing).max()
    return Comparison(what, float(np.nan_to_num(worst, nan=np.inf)), steps)


def compare_residual(what: str, out: Any, ref: Any, x: Any, tol: float) -> Comparison:
    """An fp16 output out = x + delta (a block's residual stream) against the reference's: each
    element's error less one fp16 step of the output, the most its own rounding can leave, in
    norm relative to the reference's delta (||ref - x||). Where delta is small against x (a
    block with small weights), one step of x outweighs tol * |delta| and a plain relative error
    of out - x measures the output's resolution, not the kernel. NaN anywhere fails."""
    out, ref, x = (np.asarray(a, dtype=np.float64) for a in (out, ref, x))
    if not np.all(np.isfinite(out)):
        return Comparison(what, float("inf"), tol)
    step = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    excess = np.linalg.norm(np.maximum(np.abs(out - ref) - step, 0.0))
    delta = np.linalg.norm(ref - x)
    return Comparison(what, float(excess / (delta if delta > 0 else 1.0)), tol)


@dataclass
class CheckCase:
    family: str
    kernel: str
    variant: str
    shape: dict[str, Any]
    run: Callable[[np.random.Generator], list[Comparison]]
    needs_gpu: bool = True

    @property
    def id(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in self.shape.items())
        return f"{self.kernel}[{self.variant}]({dims})"


@dataclass
class CheckResult:
    case: CheckCase
    comparisons: list[Comparison] = field(default_factory=list)
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def worst(self) -> float:
        return max((c.rel_err for c in self.comparisons), default=float("nan"))

    def failures(self) -> str:
        if self.error:
            return self.error
        bad = [f"{c.what}: {c.rel_err:.2e} > {c.tol:.0e}" for c in self.comparisons if not c.passed]
        return "; ".join(bad)


def run_case(case: CheckCase, seed: int | None = None) -> CheckResult:
    """Run one case; an exception is a failure with its message (the suite goes on)."""
    rng = np.random.default_rng(seed)
    try:
        return CheckResult(case, case.run(rng))
    except Exception as exc:  # noqa: BLE001 - reported as a failed row, not swallowed
        return CheckResult(case, error=f"{type(exc).__name__}: {exc}")
    finally:
        _release_cached_buffers()


def _release_cached_buffers() -> None:
    """Give the case's freed device buffers back: MLX keeps them cached for reuse, and twelve
    processes sharing one GPU (check-shards, tests-shards) each kept several GiB after the
    32768-token attention cases, until allocations failed with out-of-memory (b64513c)."""
    import mlx.core as mx

    mx.clear_cache()


def matches(text: str, match: str) -> bool:
    """-k's selection: `match` is in `text`, or one of its '|'-separated alternatives is."""
    return any(part in text for part in match.split("|"))
