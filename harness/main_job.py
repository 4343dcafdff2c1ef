"""The main job: `lathe` with no command, what a first run on a machine shows.

Stages, one progress bar each:
1. check: every family's `--quick` cases (one of each kernel and variant, short inputs; `full=True`:
   every case, `lathe check`'s) against their float64 references. The references run on the
   host, one core a process, so the cases go to a pool of worker processes (`jobs`, default the
   host's cores up to 16 where a GPU runs the kernels; one, in this process, without one), taken
   one at a time so that a slow case does not hold back a whole shard. On CUDA each worker
   compiles what its cases launch into the shared kernel cache, so the compiles run in parallel
   with the checks rather than before them.
2. decode: the embedded default model (tiny-llama), the reference variant everywhere and the
   kernel variants on a GPU, against llama.cpp where a llama-bench is found (harness.peers).
3. peak and bench (a GPU only): the device's copy peak, then each family's `--quick` benchmarks
   (`full=True`: every benchmark), rows and plots under results/<device>/. After the decode: their
   GPU times come from CUPTI traces, which slow every later launch's host work in the process.
4. a summary: pass/fail a family; each family's best % of the measured peak and, where the
   family benchmarks fused and unfused forms of the same shapes, the median unfused/fused time
   ratio; the decode table; the paths of what was written.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.progress import progress

# worker processes at most: each holds a GPU context (and MLX's buffer cache); on the H100's 16
# cores the whole check ran 1532 cases in 187 s in 16 processes, warm (10cb374)
MAX_JOBS = 16
DEFAULT_MODEL = ("tiny-llama", "q8_0")


@dataclass
class FamilyCheck:
    rows: list[dict] = field(default_factory=list)  # `lathe check`'s rows, in the cases' order

    @property
    def passed(self) -> int:
        return sum(row["passed"] for row in self.rows)

    @property
    def failures(self) -> list[str]:
        return [f"{row['kernel']} [{row['variant']}] {row['shape']}: {row['result'].removeprefix('FAIL ')}"
                for row in self.rows if not row["passed"]]


@dataclass
class Report:
    checks: dict[str, FamilyCheck] = field(default_factory=dict)
    bench: dict[str, list[dict]] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


# ---- stage 1: the checks in worker processes ------------------------------------------------------
_CASES: dict[tuple, list] = {}  # a process's case lists, by (family, gpu, quick), built once


def family_cases(family: str, gpu: bool, quick: bool = False) -> list:
    """A family's cases as `lathe check` takes them: the references' own, then (a GPU) the
    kernels' (quick: the first of each kernel and variant on short inputs)."""
    key = (family, gpu, quick)
    if key not in _CASES:
        from harness.suites import select

        fam = select(family)[0]
        cases = list(fam.reference_cases())
        if gpu:
            cases += one_of_each(fam.check_cases(small=True)) if quick else fam.check_cases()
        _CASES[key] = cases
    return _CASES[key]


def one_of_each(cases: list) -> list:
    """The first case of each (kernel, variant): `lathe check --quick`, a smoke run of every
    kernel path on short inputs."""
    seen, kept = set(), []
    for case in cases:
        if (case.kernel, case.variant) not in seen:
            seen.add((case.kernel, case.variant))
            kept.append(case)
    return kept


def case_size(case) -> int:
    """A case's size, the product of its shape's numbers (M x N x K, seq x heads x D, ...): the
    order in which a pool takes the cases, the float64 references' cost growing with it."""
    size = 1
    for value in case.shape.values():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            size *= value
    return int(size)


def _row(case, passed: bool, rel_err: str, why: str = "", seconds: float | None = None) -> dict:
    """A case's row as `lathe check` prints it (seconds: its wall time in its process, compiles
    included), and whether it passed."""
    return dict(kernel=case.kernel, variant=case.variant, shape=" ".join(f"{k}={v}" for k, v in case.shape.items()),
                rel_err=rel_err, seconds=None if seconds is None else round(seconds, 2),
                result="pass" if passed else f"FAIL {why}", passed=passed)


def _run_one(family: str, index: int, gpu: bool, quick: bool, seed: int | None) -> dict:
    """One case (in a worker): its row."""
    from harness.check import run_case

    case = family_cases(family, gpu, quick)[index]
    began = time.perf_counter()
    r = run_case(case, seed)
    return _row(case, r.passed, f"{r.worst:.2e}" if r.comparisons else "-", "" if r.passed else r.failures(),
                time.perf_counter() - began)


def _result(future, family: str, index: int, gpu: bool, quick: bool) -> dict:
    """A worker's row, or a failed row where the worker died (a GPU fault ends its process, and
    the pool's: every case not yet done fails with the reason, the others' rows stand)."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - reported as the case's failure, the run goes on
        return _row(family_cases(family, gpu, quick)[index], False, "-", f"{type(exc).__name__}: {exc}")


def _worker_options(values: dict) -> None:
    """A worker's experiment options: the parent's (`--set`), before its first launch."""
    from kernels import options

    options.set_options(values)


# the variables through which numpy's BLAS (OpenBLAS, MKL) and OpenMP take their thread counts
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def host_cores_shared(jobs: int) -> Iterator[None]:
    """The host's cores shared out among `jobs` worker processes started inside the block: each
    BLAS takes cores / jobs threads instead of every core. 16 workers of 16 BLAS threads each spin
    against one another; on 2 cores, 2 processes of float64 products took 1.5x as long with all
    cores each as with one (harness/NOTES.md). Variables the user set are kept."""
    threads = str(max(1, (os.cpu_count() or 1) // max(1, jobs)))
    saved = {name: os.environ.get(name) for name in BLAS_THREADS}
    for name in BLAS_THREADS:
        os.environ.setdefault(name, threads)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def host_jobs() -> int:
    """Worker processes for host work a core each: the host's cores, up to MAX_JOBS."""
    return max(1, min(os.cpu_count() or 1, MAX_JOBS))


def default_jobs(gpu: bool) -> int:
    return host_jobs() if gpu else 1


def run_checks(gpu: bool, jobs: int, seed: int | None = None, families: list[str] | None = None,
               quick: bool = False, match: str | None = None,
               shard: tuple[int, int] | None = None) -> dict[str, FamilyCheck]:
    """Every selected case of every family (or `families`) in `jobs` processes (1: this one),
    taken one at a time; each family's rows in its cases' order. match, shard: `lathe check`'s."""
    from harness.check import matches
    from harness.suites import select
    from kernels import options

    names = families or [f.name for f in select(None)]
    work = []
    for name in names:
        picked = [i for i, c in enumerate(family_cases(name, gpu, quick)) if match is None or matches(c.id, match)]
        work += [(name, i) for i in (picked[shard[0]::shard[1]] if shard else picked)]
    out = {name: FamilyCheck() for name in names}
    rows: dict[tuple[str, int], dict] = {}
    if jobs == 1:
        done = ((item, _run_one(*item, gpu, quick, seed)) for item in work)
    else:
        # the longest cases first, so that none of them starts last and holds the run's tail (the
        # whole check, warm, on 16 processes: 1532 of 1581 cases after 187 s, 10cb374): by the
        # seconds each took last time on this machine, cases not timed yet first, largest first
        last = _last_seconds()
        taken = sorted(work, key=lambda item: _longest_first(family_cases(item[0], gpu, quick)[item[1]], gpu, last))
        # spawn, not fork: a forked child of a process that has touched the GPU inherits a context it cannot use
        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                      initializer=_worker_options, initargs=(options.changed(),))
        with host_cores_shared(jobs):  # the workers start as the cases are submitted
            futures = {pool.submit(_run_one, *item, gpu, quick, seed): item for item in taken}
        done = ((futures[f], _result(f, *futures[f], gpu, quick)) for f in concurrent.futures.as_completed(futures))
    try:
        label = f"check ({jobs} process{'es' * (jobs > 1)})"
        for item, row in progress(done, len(work), label, every=15.0):
            rows[item] = row
    finally:
        if jobs > 1:
            pool.shutdown(cancel_futures=True)
    for name, i in work:
        out[name].rows.append(rows[name, i])
    if gpu:
        _keep_seconds({_seconds_key(family_cases(name, gpu, quick)[i], gpu): rows[name, i]["seconds"]
                       for name, i in work if rows[name, i]["seconds"] is not None})
    return out


def _seconds_file() -> Path:
    """Where `lathe check` keeps each case's last wall time, for the next run's order."""
    return Path(os.environ.get("LATHE_CACHE", Path.home() / ".cache" / "lathe")) / "check-seconds.json"


def _seconds_key(case, gpu: bool) -> str:
    return f"{case.family} {'gpu' if gpu else 'host'} {case.id}"


def _last_seconds() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(_seconds_file().read_text()).items()}
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: the sizes order it
        return {}


def _keep_seconds(seconds: dict[str, float]) -> None:
    try:
        path = _seconds_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_last_seconds(), **seconds}
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(merged, indent=0, sort_keys=True))
        part.replace(path)
    except OSError:  # a read-only home: the next run orders by size
        pass


def _longest_first(case, gpu: bool, last: dict[str, float]) -> tuple:
    seconds = last.get(_seconds_key(case, gpu))
    return (0, -case_size(case)) if seconds is None else (1, -seconds)


# ---- stage 3: peak and benchmarks ---------------------------------------------------------------------
def run_bench(full: bool, report: Report, bench) -> None:
    """`bench`: cli.cmd_bench (given by the CLI, which this module does not import)."""
    collected: dict = {}
    bench(None, quick=not full, repeats=7, write=True, report=collected)
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


# ---- stage 2 (decode) and the summary -----------------------------------------------------------------
def run_decode(gpu: bool, report: Report, decode) -> int:
    """`decode`: cli.cmd_decode."""
    from harness.peers import find_llama_bench

    model, qtype = DEFAULT_MODEL
    variants = "reference,unfused,fused,megafused" if gpu else "reference"
    peer = "llama.cpp" if gpu and find_llama_bench() else None
    return decode(model, qtype, 16, 32, 0, mode="compiled-pipelined" if gpu else "step", variant=variants,
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


def run(jobs: int | None = None, full: bool = False, seed: int | None = None, *, bench, decode) -> int:
    """The main job; `bench` and `decode` are the CLI's commands (cli.cmd_bench, cli.cmd_decode)."""
    from harness.results import backend_line, no_gpu_notice
    from kernels.runtime import has_gpu

    gpu = has_gpu()
    print(backend_line(), flush=True)
    if not gpu:
        no_gpu_notice()
    report = Report()
    jobs = jobs or default_jobs(gpu)
    began = time.perf_counter()
    # The quick cases: every kernel path once, which a first run needs; the whole check ran past
    # 600 s on a cold cache in 8 processes on an H100 (10cb374), 1503 of its 1581 cases done
    report.checks = run_checks(gpu, jobs, seed, quick=not full)
    report.seconds["check"] = time.perf_counter() - began
    status = 1 if any(c.failures for c in report.checks.values()) else 0
    # decode before the bench: the bench's GPU times come from CUPTI traces, and a trace slows every
    # later launch's host work in the process (harness.timing.time_calls)
    began = time.perf_counter()
    status |= run_decode(gpu, report, decode)
    report.seconds["decode"] = time.perf_counter() - began
    if gpu:
        began = time.perf_counter()
        run_bench(full, report, bench)
        report.seconds["bench"] = time.perf_counter() - began
    print(summary(report, gpu), flush=True)
    return status

