"""A kernel's time launch by launch, from Chrome traces that gpu_trace saved (serve_profile
--timeline, profile_decode --timeline): whether one kernel's launches of one workload differ by
more than their inputs explain, and whether they do so with a period.

    python -m harness.tools.launch_spread trace-1.json trace-2.json --kernel token_block

For each trace: the launches of the kernel whose name holds `--kernel` (the one of most GPU time
where none is given), their 10th, 50th, 90th percentile and longest duration (us), the
correlation of each launch's duration with the one `lag` launches later for lags 1..4 (a steady
period of p launches shows as a high correlation at lag p), the first `--first` durations in
launch order, and the median of every other kernel of the trace.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from harness.tools.gpu_trace import Kernel, read_trace


def spread(kernels: list[Kernel], kernel: str | None = None, first: int = 24) -> dict:
    """The row of one trace's kernels (module docstring); `kernel` a part of its name."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for _, duration, name in kernels:
        by_name[name].append(duration)
    if not by_name:
        raise ValueError("the trace holds no kernel")
    if kernel is None:
        name = max(by_name, key=lambda n: sum(by_name[n]))
    else:
        names = [n for n in by_name if kernel in n]
        if not names:
            raise ValueError(f"no kernel of the trace has {kernel!r} in its name")
        name = max(names, key=lambda n: sum(by_name[n]))
    runs = np.asarray(by_name[name], dtype=np.float64)
    lags = {}
    for lag in (1, 2, 3, 4):
        if len(runs) > lag + 2 and runs[:-lag].std() > 0 and runs[lag:].std() > 0:
            lags[lag] = round(float(np.corrcoef(runs[:-lag], runs[lag:])[0, 1]), 2)
    return dict(kernel=name, launches=len(runs),
                p10_50_90_max=[round(float(np.percentile(runs, q))) for q in (10, 50, 90, 100)],
                mean=round(float(runs.mean())), lag_correlation=lags,
                first=[round(float(d)) for d in runs[:first]],
                others={n: round(float(np.median(d)), 1) for n, d in by_name.items() if n != name})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.tools.launch_spread", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome traces (gpu_trace.kernel_trace's save_to)")
    p.add_argument("--kernel", help="a part of the kernel's name (default: the one of most GPU time)")
    p.add_argument("--first", type=int, default=24, help="durations printed in launch order")
    a = p.parse_args(argv)
    for path in a.traces:
        row = spread(read_trace(Path(path)), a.kernel, a.first)
        print(f"{Path(path).name}: {row['kernel'][:60]}, {row['launches']} launches")
        print(f"  us p10/50/90/max {row['p10_50_90_max']}, mean {row['mean']}; correlation at lags 1-4 "
              f"{row['lag_correlation']}")
        print(f"  in launch order: {row['first']}")
        print(f"  other kernels' medians: {({n[-40:]: v for n, v in row['others'].items()})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
