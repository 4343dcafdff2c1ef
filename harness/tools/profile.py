"""Run benchmark cases a few times each, for a profiler to watch (Nsight Compute, `ncu`).

    ncu --clock-control none -k regex:lathe --metrics gpu__time_duration.sum \\
        python -m harness.tools.profile gemv "gemv-m1 gemv_q4_0 [v2] M=1 N=14336"

Each case whose label contains the text (labels as `lathe bench` prints them: benchmark, kernel,
[variant], shape) is built once and stepped `--calls` times, one evaluation per call, so that
the profiler sees each kernel launch on its own, with no timing harness around it. `--marked`
puts a marker launch before and after each case's calls, so that `python -m harness.tools.ncu_table`
can give each case its kernels (the labels, one a line, are what this prints).
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from harness.tools.profile_decode import _marker
from harness.suites import select


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.tools.profile")
    parser.add_argument("family")
    parser.add_argument("match", nargs="*", help="texts a case label must contain (any of them)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="look among the sweep cases")
    parser.add_argument("--marked", action="store_true",
                        help="a marker launch before and after each case's calls (harness.tools.ncu_table)")
    args = parser.parse_intermixed_args(argv)
    (fam,) = select(args.family)
    cases = fam.sweep_cases() if args.sweep else fam.bench_cases()
    chosen = [c for c in cases if not args.match or any(m in c.label for m in args.match)]
    for case in chosen:
        state = case.make_set()
        mx.eval(state)
        if args.marked:  # the case's own launches sit between two markers, its inputs' outside
            _marker()
        for _ in range(args.calls):
            mx.eval(case.step(state))
        if args.marked:
            _marker()
        print(case.label)
    if not chosen:
        print("no case matched")
    return 0 if chosen else 1


if __name__ == "__main__":
    raise SystemExit(main())
