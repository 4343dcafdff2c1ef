"""The attention family's kernel targets read from a `lathe bench attention` run: `python -m
harness.tools.attention_report results/<device>/attention.csv [--sha SHA]` prints markdown tables (what
kernels/attention/NOTES.md quotes). Percentages are by GPU time (`gpu_us`, CUPTI) against the copy
peak measured in the same process; only rows run with the default options count (an A/B run's
`--set` rows are left out), the first of each case where a run timed it twice.

- Decode, batch 1 (and the chained rows): the best of flash_decode and paged v2 >= 90% at 8192
  and 32768 tokens for every head shape; by wall time ahead of MLX's sdpa at every context.
- Mixed batches of 8 and 32: >= 90% at 32768.
- Prefill: our prompt kernels (wgmma and tiled, contiguous and paged cache) >= 0.8x MLX's causal
  sdpa (sdpa's GPU time over ours) from 512 tokens.
"""

from __future__ import annotations

import pandas as pd

from harness.report import run_main

OURS = ("flash_decode", "paged_v2")
SDPA = "mlx.sdpa"


def default_rows(run: pd.DataFrame) -> pd.DataFrame:
    """The run's rows under the default options, the first of each case, with `% GPU`: bytes
    over gpu_us as a share of the run's peak."""
    rows = run[run.options.fillna("") == ""] if "options" in run.columns else run
    rows = rows.drop_duplicates(["benchmark", "kernel", "variant", "batch", "ctx", "tokens", "pos"], keep="first")
    return rows.assign(**{"% GPU": 100 * rows.bytes / rows.gpu_us / 1e3 / rows.peak_gbs})


def decode_table(run: pd.DataFrame) -> pd.DataFrame:
    """Batch 1 (and its chained rows): each kernel's % of peak by GPU time, the best of ours
    against the 90% floor from 8192 tokens, and the wall time of the faster of ours against
    sdpa's."""
    rows = default_rows(run)
    rows = rows[rows.benchmark.isin(["attention-decode-b1", "attention-decode-chain-b1"])]
    out = []
    for (bench, heads, ctx), case in rows.groupby(["benchmark", "variant", "ctx"], sort=False):
        k = case.set_index("kernel")
        ours = k.loc[[name for name in OURS if name in k.index]]
        if ours.empty or SDPA not in k.index:
            continue
        best = ours["% GPU"].max()
        wall = ours.us.min()
        out.append({"rows": bench.removeprefix("attention-decode-"), "heads": heads, "ctx": int(ctx),
                    **{f"{name} %": round(k["% GPU"].get(name, float("nan")), 1) for name in (*OURS, SDPA)},
                    "met (>= 90)": ("yes" if best >= 90 else "no") if ctx >= 8192 else "",
                    "wall us, ours / sdpa": f"{wall:.1f} / {k.us[SDPA]:.1f}",
                    "ahead by wall": "yes" if wall < k.us[SDPA] else "no"})
    return pd.DataFrame(out)


def mixed_table(run: pd.DataFrame) -> pd.DataFrame:
    """Mixed batches: each kernel's % of peak by GPU time (sdpa through a mask), ours' rel_err
    against sdpa, and the 90% floor at 32768 tokens."""
    rows = default_rows(run)
    rows = rows[rows.benchmark.str.endswith("-mixed")]
    out = []
    for (bench, heads, ctx), case in rows.groupby(["benchmark", "variant", "ctx"], sort=False):
        k = case.set_index("kernel")
        best = k.loc[[name for name in OURS if name in k.index], "% GPU"].max()
        out.append({"rows": bench.removeprefix("attention-decode-"), "heads": heads, "longest ctx": int(ctx),
                    **{f"{name} %": round(k["% GPU"].get(name, float("nan")), 1)
                       for name in ("flash_decode", "paged_v1", "paged_v2", SDPA)},
                    "paged v2 rel_err": f"{k.rel_err.get('paged_v2', float('nan')):.1e}",
                    "met (>= 90)": ("yes" if best >= 90 else "no") if ctx >= 32768 else ""})
    return pd.DataFrame(out)


PREFILL_OURS = ("wgmma", "tiled", "wgmma paged", "tiled paged")


def prefill_table(run: pd.DataFrame) -> pd.DataFrame:
    """Prefill: each of our prompt kernels (contiguous and paged cache) against MLX's causal sdpa
    (over the contiguous cache: it takes no other), by GPU time and by wall time, and its TFLOP/s;
    the 0.8x floor from 512 tokens."""
    rows = default_rows(run)
    rows = rows[rows.benchmark == "attention-prefill"]
    out = []
    for (heads, tokens, pos), case in rows.groupby(["variant", "tokens", "pos"], sort=False):
        k = case.set_index("kernel")
        if SDPA not in k.index:
            continue
        for ours in (o for o in PREFILL_OURS if o in k.index):
            ratio = k.gpu_us[SDPA] / k.gpu_us[ours]
            out.append({"heads": heads, "tokens": int(tokens), "pos": int(pos), "kernel": ours,
                        "gpu_us": k.gpu_us[ours], "sdpa gpu_us": k.gpu_us[SDPA],
                        "sdpa / ours (GPU)": round(ratio, 2), "sdpa / ours (wall)": round(k.us[SDPA] / k.us[ours], 2),
                        "TFLOP/s": round(k.flops[ours] / k.gpu_us[ours] / 1e6, 1),
                        "met (>= 0.8)": ("yes" if ratio >= 0.8 else "no") if tokens >= 512 else ""})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, "python -m harness.tools.attention_report", __doc__.split("\n")[0],
                    lambda run: [decode_table(run), mixed_table(run), prefill_table(run)])


if __name__ == "__main__":
    raise SystemExit(main())
