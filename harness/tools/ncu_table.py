"""Nsight Compute's view of benchmark cases, one row per case and kernel: GPU time, DRAM
throughput (% of its peak, and GB/s read), achieved occupancy, issue-slot use and the top stall
reasons (each GEMV shape is profiled before it is changed).

    ncu --clock-control none --page raw --csv --log-file ncu.csv \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python -m harness.tools.profile gemv --marked "gemv_q4_0 [v2] M=1" > labels.txt
    python -m harness.tools.ncu_table ncu.csv labels.txt [--csv out.csv]

The launches of case i are those between the (2i)th and (2i+1)th marker launch (harness.tools.profile
--marked); labels.txt holds the cases' labels in the same order. ncu's CSV comes in two shapes,
both read here: `--page raw`, a wide table (a header of metric names, a row of units, a row per
launch), and the details page, a long one (a row per launch and metric).
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict
from pathlib import Path
from statistics import median

from harness.tools.profile_decode import MARKER, UNITS

TIME = "gpu__time_duration.sum"
# What the table shows -> the raw metrics that give it, the first present wins (the sections'
# metrics differ between ncu versions: ncu 2025 on the H200 wrote gpu__dram_throughput and
# sm__issue_active, and DRAM bytes only as a rate).
COLUMNS = {
    "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                 "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    "dram_read_bytes": ("dram__bytes_read.sum",),
    "dram_bytes_per_s": ("dram__bytes.sum.per_second",),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "issue_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active",
                  "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
    "registers": ("launch__registers_per_thread",),
    # the L2's hit rates: all sectors, and the loads' reads alone (a prefetch's lines found by the
    # loads after it show in the second; `.ci/device token-ncu` asks for it by --metrics)
    "l2_hit_pct": ("lts__t_sector_hit_rate.pct",),
    "l2_read_hit_pct": ("lts__t_sector_op_read_hit_rate.pct",),
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def _scaled(name: str, value: float | None, unit: str) -> float | None:
    """Times in us, bytes in bytes; other units as they are."""
    if value is None:
        return None
    if name == TIME:
        return value * UNITS.get(unit, 1.0)
    if name.startswith("dram__bytes") and not name.endswith("per_second"):
        return value * BYTES.get(unit, 1.0)
    return value


def read_launches(path: Path) -> list[tuple[str, dict[str, float]]]:
    """(kernel name, {metric: value}) per launch, in launch order."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not quoted
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header = rows[0]
    launches: dict[int, tuple[str, dict[str, float]]] = {}
    if "Metric Name" in header:  # the long shape
        col = {h: i for i, h in enumerate(header)}
        for row in rows[1:]:
            at = int(row[col["ID"]])
            name, metrics = launches.setdefault(at, (row[col["Kernel Name"]], {}))
            metric = row[col["Metric Name"]]
            metrics[metric] = _scaled(metric, _number(row[col["Metric Value"]]), row[col["Metric Unit"]])
    else:  # the raw page: header, units, then a row per launch
        units = rows[1]
        for row in rows[2:]:
            values = dict(zip(header, row))
            metrics = {m: _scaled(m, _number(v), u) for m, v, u in zip(header, row, units)
                       if "__" in m}
            launches[int(values["ID"])] = (values["Kernel Name"], metrics)
    return [launches[k] for k in sorted(launches)]


def table(launches: list[tuple[str, dict[str, float]]], labels: list[str] | None) -> list[dict]:
    """One row per case and kernel (medians over the case's calls). labels=None: one row per kernel
    over every launch, for a profile whose kernel filter left the markers out (its case column
    empty: the launches say their kernel, not which case ran them)."""
    marks = [i for i, (name, _) in enumerate(launches) if MARKER in name]
    if labels is None:
        cases = [("", [launch for launch in launches if MARKER not in launch[0]])]
    elif len(marks) != 2 * len(labels):
        raise ValueError(f"{len(marks)} marker launches for {len(labels)} cases: expected two a case "
                         f"(run harness.tools.profile with --marked, and let ncu's kernel filter take "
                         f"the markers' kernel, '{MARKER}'; or --by-kernel)")
    else:
        cases = [(label, launches[marks[2 * i] + 1: marks[2 * i + 1]]) for i, label in enumerate(labels)]
    out = []
    for label, case_launches in cases:
        by_kernel: dict[str, list[dict]] = defaultdict(list)
        for name, metrics in case_launches:
            by_kernel[name.split("(")[0]].append(metrics)
        for kernel, calls in by_kernel.items():
            med = lambda m: median(v for c in calls if (v := c.get(m)) is not None) \
                if any(c.get(m) is not None for c in calls) else None  # noqa: E731
            row = dict(case=label, kernel=kernel, launches=len(calls), gpu_us=med(TIME))
            for column, names in COLUMNS.items():
                row[column] = next((v for m in names if (v := med(m)) is not None), None)
            rate = row.pop("dram_bytes_per_s")
            row["dram_gbs"] = (row["dram_read_bytes"] / row["gpu_us"] / 1e3 if row["gpu_us"] and row["dram_read_bytes"]
                               else rate / 1e9 if rate else None)  # reads, or all DRAM traffic
            stalls = {m.group(1): med(name) for name in calls[0] if (m := STALL.fullmatch(name))}
            top = sorted(((v, k) for k, v in stalls.items() if v), reverse=True)[:3]
            row["top_stalls"] = ", ".join(f"{k} {v:.2f}" for v, k in top)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    parser = argparse.ArgumentParser(prog="python -m harness.tools.ncu_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ncu_csv", type=Path)
    parser.add_argument("labels", type=Path, nargs="?", help="harness.tools.profile --marked's output: a label a line")
    parser.add_argument("--csv", type=Path, help="also write the table here")
    parser.add_argument("--by-kernel", action="store_true",
                        help="a row per kernel over all launches, the markers and labels not used")
    args = parser.parse_args(argv)
    if args.labels is None and not args.by_kernel:
        parser.error("give the labels file, or --by-kernel")
    labels = None if args.by_kernel else \
        [line.strip() for line in args.labels.read_text().splitlines() if line.strip()]
    rows = table(read_launches(args.ncu_csv), labels)
    frame = pd.DataFrame(rows)
    if args.csv:
        frame.to_csv(args.csv, index=False)
    with pd.option_context("display.max_colwidth", 60, "display.width", 250, "display.float_format", "{:.1f}".format):
        print(frame.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
