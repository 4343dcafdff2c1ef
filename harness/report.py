"""What the target reports share (harness.tools.gemv_report, harness.tools.attention_report): a markdown table,
and the command that picks one benchmark run out of a results CSV and prints its tables."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import pandas as pd


def markdown(table: pd.DataFrame) -> str:
    """A markdown table (pandas' to_markdown needs tabulate, which lathe does not install)."""
    cells = [[("" if pd.isna(v) else f"{v:g}" if isinstance(v, float) else str(v)) for v in row]
             for row in table.itertuples(index=False)]
    lines = [list(map(str, table.columns)), ["---"] * len(table.columns), *cells]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def run_main(argv: list[str] | None, prog: str, description: str,
             tables: Callable[[pd.DataFrame], list[pd.DataFrame]],
             keep: Callable[[pd.DataFrame], pd.DataFrame] = lambda df: df) -> int:
    """`prog CSV [--sha SHA]`: the run of SHA (default: the newest by date) among the rows `keep`
    leaves, its tables as markdown; exit 1 where that run has no GPU time."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("csv")
    parser.add_argument("--sha", help="the run's git_sha (default: the newest run)")
    args = parser.parse_args(argv)
    df = keep(pd.read_csv(args.csv, dtype={"git_sha": str, "options": str}))  # "5e79645" reads as a float
    sha = args.sha or df.sort_values("date").git_sha.iloc[-1]
    run = df[df.git_sha == sha]
    if run.empty or run.gpu_us.isna().all():
        print(f"{args.csv}: no rows with gpu_us for {sha}", file=sys.stderr)
        return 1
    print(f"{args.csv}, run {sha} ({run.device.iloc[0]}, peak {run.peak_gbs.median():.0f} GB/s), "
          f"{run.gpu_us.notna().sum()} of {len(run)} rows with gpu_us\n")
    print("\n\n".join(markdown(t) for t in tables(run)))
    return 0
