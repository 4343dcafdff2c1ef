"""Kernel families: each has a correctness suite, reference self-checks and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    check_cases: Callable[..., list]  # GPU correctness cases (small=True: short inputs)
    reference_cases: Callable[[], list]  # CPU: references against independent opinions
    bench_cases: Callable[..., list]
    plots: Callable | None
    sweep_cases: Callable[[], list] | None = None  # launch-knob sweeps (lathe bench --sweep)


def families() -> dict[str, Family]:
    from harness.suites import attention, blocks, gemv, launch, loop, rope, rope_bench

    return {
        "rope": Family("rope", rope.check_cases, rope.reference_cases, rope_bench.bench_cases,
                       rope_bench.plots, rope_bench.sweep_cases),
        "gemv": Family("gemv", gemv.check_cases, gemv.reference_cases, gemv.bench_cases,
                       gemv.plots, gemv.sweep_cases),
        "attention": Family("attention", attention.check_cases, attention.reference_cases,
                            attention.bench_cases, attention.plots),
        "blocks": Family("blocks", blocks.check_cases, blocks.reference_cases, blocks.bench_cases, None),
        "loop": Family("loop", loop.check_cases, loop.reference_cases, loop.bench_cases, None),
        "launch": Family("launch", launch.check_cases, launch.reference_cases, launch.bench_cases, None),
    }


def select(name: str | None) -> list[Family]:
    known = families()
    if name is None:
        return list(known.values())
    if name not in known:
        raise SystemExit(f"unknown family {name!r}; known: {', '.join(known)}")
    return [known[name]]
