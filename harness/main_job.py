"""The main job: `lathe` with no command, what a first run on a machine shows.

Stages, one progress bar each:
1. check: every family's cases against their float64 references. The references run on the
   host, one core a process, so the cases go to a pool of worker processes (`jobs`, default the
   host's cores up to 8 where a GPU runs the kernels; one, in this process, without one), taken
   one at a time so that a slow case does not hold back a whole shard. On CUDA each worker
   compiles what its cases launch into the shared kernel cache, so the compiles run in parallel
   with the checks rather than before them.
2. peak and bench (a GPU only): the device's copy peak, then each family's `--quick` benchmarks
   (`full=True`: every benchmark), rows and plots under results/<device>/.
3. decode: the embedded default model (tiny-llama), the reference variant everywhere and the
   kernel variants on a GPU, against llama.cpp where a llama-bench is found (harness.peers).
4. a summary: pass/fail a family; each family's best % of the measured peak and, where the
   family benchmarks fused and unfused forms of the same shapes, the median unfused/fused time
   ratio; the decode table; the paths of what was written.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field

import pandas as pd

from harness.progress import progress

MAX_JOBS = 8  # worker processes at most: each holds a GPU context (and MLX's buffer cache)
DEFAULT_MODEL = ("tiny-llama", "q8_0")


@dataclass
class FamilyCheck:
    passed: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class Report:
    checks: dict[str, FamilyCheck] = field(default_factory=dict)
    bench: dict[str, list[dict]] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


# ---- stage 1: the checks in worker processes ------------------------------------------------------
_CASES: dict[str, list] = {}  # a worker's case lists, by family, built once


def _family_cases(family: str, gpu: bool) -> list:
    """A family's cases as `lathe check` takes them: the references' own, then (a GPU) the kernels'."""
    if family not in _CASES:
        from harness.suites import select

        fam = select(family)[0]
        _CASES[family] = list(fam.reference_cases()) + (fam.check_cases() if gpu else [])
    return _CASES[family]


def _run_one(family: str, index: int, gpu: bool, seed: int | None) -> tuple[str, bool, str]:
    """One case (in a worker): (its label, passed, what failed)."""
    from harness.check import run_case

    case = _family_cases(family, gpu)[index]
    result = run_case(case, seed)
    label = f"{case.kernel} [{case.variant}] " + " ".join(f"{k}={v}" for k, v in case.shape.items())
    return label, result.passed, "" if result.passed else result.failures()


def default_jobs(gpu: bool) -> int:
    return max(1, min(os.cpu_count() or 1, MAX_JOBS)) if gpu else 1


def run_checks(gpu: bool, jobs: int, seed: int | None = None, families: list[str] | None = None) -> dict[str, FamilyCheck]:
    """Every case of every family (or `families`), in `jobs` processes (1: this one)."""
    from harness.suites import select

    names = families or [f.name for f in select(None)]
    work = [(name, i) for name in names for i in range(len(_family_cases(name, gpu)))]
    out = {name: FamilyCheck() for name in names}
    if jobs == 1:
        results = (_run_one(name, i, gpu, seed) for name, i in work)
        done = zip(work, results)
    else:
        # spawn, not fork: a forked child of a process that has touched the GPU inherits a context it cannot use
        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        futures = {pool.submit(_run_one, name, i, gpu, seed): (name, i) for name, i in work}
        done = ((futures[f], f.result()) for f in concurrent.futures.as_completed(futures))
    try:
        for (name, _), (label, passed, why) in progress(done, len(work), f"check ({jobs} process{'es' * (jobs > 1)})",
                                                         every=15.0):
            if passed:
                out[name].passed += 1
            else:
                out[name].failures.append(f"{label}: {why}")
    finally:
        if jobs > 1:
            pool.shutdown(cancel_futures=True)
    return out


# ---- stage 2: peak and benchmarks ---------------------------------------------------------------------
def run_bench(full: bool, report: Report) -> None:
    from harness.cli import cmd_bench

    collected: dict = {}
    cmd_bench(None, quick=not full, repeats=7, write=True, report=collected)
    for family, (rows, paths) in collected.items():
        report.bench[family] = rows
        report.written += [str(p) for p in paths]


def bench_summary(rows: list[dict]) -> tuple[float | None, float | None]:
    """(best % of the measured peak, median unfused/fused time ratio over the shapes that have
    both) of a family's rows; None where it has none."""
    df = pd.DataFrame(rows)
    if df.empty or "pct_peak" not in df:
        return None, None
    best = pd.to_numeric(df.pct_peak, errors="coerce").max()
    key = [c for c in ("benchmark", "kernel", "M", "N", "K", "seq", "ctx", "batch") if c in df.columns]
    fused = df[df.variant.astype(str).str.startswith("fused")].groupby(key, dropna=False).us.min()
    unfused = df[df.variant.astype(str) == "unfused"].groupby(key, dropna=False).us.min()
    both = fused.index.intersection(unfused.index)
    ratio = float((unfused[both] / fused[both]).median()) if len(both) else None
    return (None if pd.isna(best) else float(best)), ratio


# ---- stage 3 and the summary -----------------------------------------------------------------------------
def run_decode(gpu: bool, report: Report) -> int:
    from harness.cli import cmd_decode
    from harness.peers import find_llama_bench

    model, qtype = DEFAULT_MODEL
    variants = "reference,unfused,fused,megafused" if gpu else "reference"
    peer = "llama.cpp" if gpu and find_llama_bench() else None
    return cmd_decode(model, qtype, 16, 32, 0, mode="compiled-pipelined" if gpu else "step", variant=variants,
                      peer=peer, out_rows=report.decode)


def summary(report: Report, gpu: bool) -> str:
    lines = ["", "== lathe: summary"]
    rows = []
    for name, chk in report.checks.items():
        best, ratio = bench_summary(report.bench.get(name, []))
        rows.append(dict(family=name, checks=f"{chk.passed} passed, {len(chk.failures)} failed",
                         best_pct_peak=None if best is None else round(best, 1),
                         unfused_over_fused=None if ratio is None else round(ratio, 2)))
    table = pd.DataFrame(rows)
    if not gpu:
        table = table.drop(columns=["best_pct_peak", "unfused_over_fused"])
    lines.append(table.to_string(index=False))
    for name, chk in report.checks.items():
        lines += [f"  FAIL {name}: {why}" for why in chk.failures[:20]]
        if len(chk.failures) > 20:
            lines.append(f"  ... and {len(chk.failures) - 20} more failures in {name}")
    if report.decode:
        cols = [c for c in ("model", "qtype", "variant", "mode", "decode_tok_s", "x_llama_cpp", "error")
                if any(c in r for r in report.decode)]
        lines += ["", pd.DataFrame(report.decode).reindex(columns=cols).dropna(axis=1, how="all").to_string(index=False)]
    if report.written:
        lines += ["", "written:"] + [f"  {p}" for p in report.written]
    lines.append("stages: " + ", ".join(f"{k} {v:.0f} s" for k, v in report.seconds.items()))
    if not gpu:
        lines.append("No GPU backend here: the kernels were not run (the reference checks and decode were).")
    return "\n".join(lines)


def run(jobs: int | None = None, full: bool = False, seed: int | None = None) -> int:
    from harness.cli import _backend_line, _no_gpu_notice
    from kernels.runtime import has_gpu

    gpu = has_gpu()
    print(_backend_line(), flush=True)
    if not gpu:
        _no_gpu_notice()
    report = Report()
    jobs = jobs or default_jobs(gpu)
    began = time.perf_counter()
    report.checks = run_checks(gpu, jobs, seed)
    report.seconds["check"] = time.perf_counter() - began
    status = 1 if any(c.failures for c in report.checks.values()) else 0
    if gpu:
        began = time.perf_counter()
        run_bench(full, report)
        report.seconds["bench"] = time.perf_counter() - began
    began = time.perf_counter()
    status |= run_decode(gpu, report)
    report.seconds["decode"] = time.perf_counter() - began
    print(summary(report, gpu), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(run())
