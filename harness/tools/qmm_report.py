"""The quantized GEMM's target read from a `lathe bench gemv --sweep` run: `python -m
harness.tools.qmm_report results/<device>/gemv.csv [--sha SHA]` prints a markdown table (what
kernels/gemv/NOTES.md and the closing notes quote), a row per matrix and row count of the sweep.

- `rule`: the knobs qmm_by_shape launches today (the code this tool runs with, under the default
  options), as the sweep's variant label, and its GPU time where the run swept it;
- `best`: the run's fastest setting and its GPU time (`gpu_us`, CUPTI; the median of a setting's
  rows);
- `% peak`: the bytes a call must move (W, X and Y) over the GPU time, as a share of the copy peak
  measured in the same process, for the rule and for the best;
- the GEMM's target: at M = 16, >= 80% on the 8B's shapes (K from 4096), by the rule.
"""

from __future__ import annotations

import pandas as pd

from harness.report import run_main

TARGET_PCT = 80.0


def rule_label(qtype: str, m: int, n: int, k: int) -> str:
    """The sweep's label of what qmm launches unasked for M rows of a `qtype` [N, K] matrix today."""
    from harness.suites.gemv import qmm_sweep_label
    from kernels.gemv import qmm_by_shape, qmm_split_k

    shaped = qmm_by_shape(m, n, k, qtype)
    groups = -(-n // (8 * shaped["NB"] * shaped["WN"]))
    ks, _ = qmm_split_k(k, groups, m, shaped["WN"] * shaped["WK"], bool(shaped["PF"] or shaped["WR"]),
                        bool(shaped["SPLIT"]))
    return qmm_sweep_label(dict(nb=shaped["NB"], wn=shaped["WN"], wk=shaped["WK"], ks=ks,
                                pf=shaped["PF"], xs=shaped["XS"], wr=shaped["WR"]))


def sweep_table(run: pd.DataFrame) -> pd.DataFrame:
    rows = run[(run.benchmark == "gemv-sweep") & run.variant.str.startswith("qmm ")].copy()
    rows[["M", "N", "K"]] = rows[["M", "N", "K"]].astype(int)
    rows["pct"] = 100 * rows.bytes / rows.gpu_us / 1e3 / rows.peak_gbs
    out = []
    for (kernel, m, n, k), shape in rows.groupby(["kernel", "M", "N", "K"]):
        by = shape.groupby("variant")[["gpu_us", "pct"]].median().sort_values("gpu_us")
        label = rule_label(kernel.removeprefix("gemv_"), m, n, k)
        rule = by.loc[label] if label in by.index else None
        judged = m == 16 and k >= 4096
        out.append({"kernel": kernel, "M": m, "N": n, "K": k, "rule": label,
                    "rule us": None if rule is None else round(rule.gpu_us, 1),
                    "rule % peak": None if rule is None else round(rule.pct, 1),
                    "best": by.index[0], "best us": round(by.gpu_us.iloc[0], 1), "best % peak": round(by.pct.iloc[0], 1),
                    "target %": TARGET_PCT if judged else None,
                    "met": "" if not judged or rule is None else "yes" if rule.pct >= TARGET_PCT else "no"})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, "python -m harness.tools.qmm_report", __doc__.split("\n")[0],
                    lambda run: [sweep_table(run)],
                    keep=lambda df: df[(df.benchmark == "gemv-sweep") & df.variant.str.startswith("qmm ")])


if __name__ == "__main__":
    raise SystemExit(main())
