"""The GEMV family's kernel targets read from a `lathe bench gemv` run: `python -m harness.tools.gemv_report
results/<device>/gemv.csv [--sha SHA]` prints markdown tables (what kernels/gemv/NOTES.md quotes).

- M = 1, by GPU time (`gpu_us`, CUPTI) as % of the copy peak measured in the same process:
  >= 85% at the large shapes, >= 75% at 4096x4096 and QKV's 6144x4096, >= 50% at Qwen3-0.6B's;
  for the GEMVs the decode loop runs (v3 on repacked weights, the fused v3 forms) and MLX's peers.
- Wall time per call over GPU time: <= 1.15 from 14336x4096 up.
- M = 2..4 over M = 1's GPU time: <= 1.3 at the large shapes (the weights read once for all rows).
"""

from __future__ import annotations

import pandas as pd

from harness.report import markdown, run_main  # noqa: F401 - markdown: this module's users

LARGE = {(4096, 14336), (14336, 4096), (28672, 4096), (128256, 4096)}
MID = {(4096, 4096), (6144, 4096)}
QWEN3 = {(1024, 3072), (3072, 1024), (4096, 1024), (151936, 1024), (1024, 4096)}


def target(n: int, k: int) -> float | None:
    """The target floor (% of peak by GPU time) for an N x K matrix; None where it names none."""
    return 85.0 if (n, k) in LARGE else 75.0 if (n, k) in MID else 50.0 if (n, k) in QWEN3 else None


def _rows_n(n) -> int:
    """A fused row's N ("4096+1024+1024", "14336+14336") as the matrix it reads."""
    return sum(int(part) for part in str(n).split("+"))


def m1_table(run: pd.DataFrame) -> pd.DataFrame:
    keep = run[((run.benchmark == "gemv-m1") & run.variant.isin(["v3", "fp16", "4bit-gs32", "8bit-gs32"]))
               | ((run.benchmark == "gemv-fused") & (run.variant == "fused-v3")
                  & ~run.kernel.str.startswith(("qkv_pair", "ffn_")))].copy()
    keep["N"] = keep.N.map(_rows_n)
    keep["K"] = keep.K.astype(int)
    gbs = keep.bytes / keep.gpu_us / 1e3
    keep["% peak (GPU)"] = (100 * gbs / keep.peak_gbs).round(1)
    keep["% peak (wall)"] = keep.pct_peak.round(1)
    keep["wall / GPU"] = (keep.us / keep.gpu_us).round(2)
    keep["target %"] = [target(n, k) for n, k in zip(keep.N, keep.K)]
    ours = ~keep.kernel.str.startswith("mlx.")
    keep["met"] = ""
    keep.loc[ours & keep["target %"].notna(), "met"] = (keep["% peak (GPU)"] >= keep["target %"]).map({True: "yes", False: "no"})
    keep["wall met"] = ""
    tall = ours & (keep.N * keep.K >= 14336 * 4096)
    keep.loc[tall, "wall met"] = (keep["wall / GPU"] <= 1.15).map({True: "yes", False: "no"})
    cols = ["kernel", "variant", "N", "K", "gpu_us", "us", "% peak (GPU)", "% peak (wall)", "target %", "met",
            "wall / GPU", "wall met"]
    return keep[cols].sort_values(["kernel", "N", "K"])


def m_table(run: pd.DataFrame) -> pd.DataFrame:
    rows = run[(run.benchmark == "gemv-batched") & (run.variant == "gemv-v3")].copy()
    rows[["M", "N", "K"]] = rows[["M", "N", "K"]].astype(int)
    one = rows[rows.M == 1].set_index(["kernel", "N", "K"]).gpu_us
    rows = rows[rows.M.between(2, 4)]
    rows["M1 gpu_us"] = [one.get((r.kernel, r.N, r.K)) for r in rows.itertuples()]
    rows["over M = 1"] = (rows.gpu_us / rows["M1 gpu_us"]).round(2)
    # a boolean Series: a plain list that comes out empty (a run with no M = 2..4 rows, as a
    # --quick bench) would select no columns instead of no rows
    rows = rows[pd.Series([(n, k) in LARGE for n, k in zip(rows.N, rows.K)], index=rows.index, dtype=bool)]
    rows["met (<= 1.3)"] = (rows["over M = 1"] <= 1.3).map({True: "yes", False: "no"})
    return rows[["kernel", "N", "K", "M", "gpu_us", "M1 gpu_us", "over M = 1", "met (<= 1.3)"]]


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, "python -m harness.tools.gemv_report", __doc__.split("\n")[0],
                    lambda run: [m1_table(run), m_table(run)],
                    keep=lambda df: df[df.benchmark != "gemv-sweep"])


if __name__ == "__main__":
    raise SystemExit(main())
