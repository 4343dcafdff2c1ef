"""Benchmarks: time each case with harness.timing, scale by its roofline and by the peak measured
in the same process, append rows to results/<device>/<family>.csv and draw the family's plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from harness.timing import Rounds, State, Timing, l2_bytes, time_calls, traced_gpu_us


@dataclass
class BenchCase:
    family: str
    benchmark: str
    kernel: str
    variant: str
    shape: dict[str, Any]
    make_set: Callable[[], State]
    step: Callable[[State], list]
    bytes: int  # the roofline: bytes the operation must move
    flops: int
    set_bytes: int  # size of one input set, for the rotation over > 4x L2
    verify: Callable[[], float] | None = None  # optional: rel_err of this path's output

    @property
    def label(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"{self.benchmark} {self.kernel} [{self.variant}] {dims}"


def time_case(case: BenchCase, *, l2: int, repeats: int = 7, gpu_time: bool = True) -> Timing:
    return time_calls(case.make_set, case.step, case.set_bytes, l2=l2, repeats=repeats, gpu_time=gpu_time)


def timing_row(benchmark: str, kernel: str, variant: str, nbytes: int, flops: int,
               shape: dict[str, Any], timing: Timing, peak_gbs: float, meta: dict, backend: str,
               device: str, rel_err: float | str = "") -> dict:
    """One results row: a timing scaled by its roofline bytes and by the measured peak."""
    gbs = nbytes / (timing.us * 1e-6) / 1e9
    return dict(
        benchmark=benchmark, kernel=kernel, variant=variant, backend=backend,
        device=device, us=round(timing.us, 3), us_min=round(timing.us_min, 3),
        us_max=round(timing.us_max, 3), gbs=round(gbs, 2), pct_peak=round(100 * gbs / peak_gbs, 2),
        peak_gbs=round(peak_gbs, 1), bytes=nbytes, flops=flops, launches=timing.launches,
        repeats=timing.repeats, rel_err=rel_err, compile_s=round(timing.compile_s, 3),
        host_us=round(timing.host_us, 2), gpu_us=round(timing.gpu_us, 3),
        gpu_kernels=timing.gpu_kernels,
        **meta, **shape,
    )


def result_row(case: BenchCase, timing: Timing, peak_gbs: float, meta: dict, backend: str,
               device: str, rel_err: float | str = "") -> dict:
    return timing_row(case.benchmark, case.kernel, case.variant, case.bytes, case.flops,
                      case.shape, timing, peak_gbs, meta, backend, device, rel_err)


def run_cases(cases: list[BenchCase], peak_gbs: float, backend: str, device: str, meta: dict,
              repeats: int = 7, progress_label: str = "bench", gpu_time: bool = True) -> list[dict]:
    """Every case's wall time, then (`gpu_time`) every case's GPU time (add_gpu_time): no wall time
    is taken after a CUPTI trace, which slows every later launch's host work in the process
    (harness.timing.time_calls). A caller with more cases to time passes gpu_time=False and adds
    the GPU times after all of them."""
    from harness.progress import progress

    l2 = l2_bytes(device)
    rows = []
    for case in progress(cases, len(cases), progress_label):
        err = case.verify() if case.verify else ""
        rows.append(result_row(case, time_case(case, l2=l2, repeats=repeats, gpu_time=False), peak_gbs, meta,
                               backend, device, err))
    if gpu_time:
        add_gpu_time(cases, rows, device, progress_label)
    return rows


def add_gpu_time(cases: list[BenchCase], rows: list[dict], device: str, progress_label: str = "bench") -> None:
    """Each case's GPU time (CUPTI: gpu_us, gpu_kernels) into its row, on input sets made again."""
    from harness.progress import progress

    l2 = l2_bytes(device)
    for case, row in progress(list(zip(cases, rows)), len(rows), f"{progress_label} (GPU time)"):
        gpu_us, split = traced_gpu_us(Rounds(case.make_set, case.step, case.set_bytes, l2=l2))
        row.update(gpu_us=round(gpu_us, 3), gpu_kernels=split)


def summary(rows: list[dict]) -> pd.DataFrame:
    """The short table printed after a run: one line per case."""
    df = pd.DataFrame(rows)
    shape_cols = [c for c in ("seq", "M", "N", "K", "ctx", "batch") if c in df.columns]
    cols = ["benchmark", "kernel", "variant", *shape_cols, "us", "gbs", "pct_peak", "host_us"]
    if "gpu_us" in df.columns and df.gpu_us.notna().any():  # traced on CUDA (harness.timing)
        cols.append("gpu_us")
    return df[cols + (["rel_err"] if (df.rel_err != "").any() else [])]


def write_results(root: Path, family: str, rows: list[dict], device: str,
                  plots: Callable[[pd.DataFrame, Path, float], list[Path]] | None,
                  peak_gbs: float) -> tuple[Path, list[Path]]:
    from harness.results import append_rows, results_dir

    from harness.results import read_results

    out_dir = results_dir(root, device)
    csv = append_rows(out_dir / f"{family}.csv", family, rows)
    # Plots are drawn from the CSV (the newest row of each line and size wins).
    drawn = plots(read_results(csv), out_dir, peak_gbs) if plots else []
    return csv, drawn
