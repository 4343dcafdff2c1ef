"""Plots drawn from results CSV frames (see harness.results)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: device machines and CI have no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

DPI = 130


def _as_tuple(cols: str | Sequence[str]) -> tuple[str, ...]:
    return (cols,) if isinstance(cols, str) else tuple(cols)


def _require(df: pd.DataFrame, cols: Sequence[str], what: str) -> None:
    if df is None or len(df) == 0:
        raise ValueError(f"{what}: no rows to plot")
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: missing column(s) {missing}; have {list(df.columns)}")


def _latest(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One row per key: the most recent by `date` (ISO strings sort in time order)."""
    if "date" in df.columns:
        df = df.sort_values("date", kind="stable", na_position="first")
    return df.drop_duplicates(subset=list(keys), keep="last")


RUN = ["git_sha", "date"]  # the rows of one run (one command) share both (results.run_metadata)


def _runs(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The runs of these rows, oldest first (rows without provenance are one unnamed run)."""
    if not set(RUN) <= set(df.columns):
        return []
    found = df[RUN].astype(str).drop_duplicates().itertuples(index=False, name=None)
    return sorted(found, key=lambda run: run[1])


def _run_label(df: pd.DataFrame, sep: str = ", ", within: str = " ") -> str:
    """The runs of these rows, each as `sha MM-DD HH:MM` (UTC; `within` between sha and date)."""
    return sep.join(f"{sha}{within}{date[5:16].replace('T', ' ')}" for sha, date in _runs(df))


def _newest_run_per(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """For each key, all the rows of the newest run that has it (its rounds included; a run is
    one command, whose rows share their date)."""
    if not set(RUN) <= set(df.columns):
        return df
    newest = df.groupby(list(keys), dropna=False)["date"].transform("max")
    return df[df["date"] == newest]


def _say_if_runs_mix(fig: plt.Figure, data: pd.DataFrame) -> None:
    """A footnote naming the runs when a plot's rows come from more than one (compare across
    them as ratios only: machines of one kind differ by up to 1.4x)."""
    runs = _runs(data)
    if len(runs) > 1:
        fig.text(0.01, -0.02, f"rows of {len(runs)} runs (git sha, date): {_run_label(data)}; "
                 "compare across runs as ratios only", fontsize="x-small", ha="left", va="top", wrap=True)


def _label(values: object) -> str:
    vals = values if isinstance(values, tuple) else (values,)
    return " / ".join(str(v) for v in vals)


def _save(fig: plt.Figure, out_path: str | Path) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=DPI, bbox_inches="tight")  # keeps an outside legend in frame
    finally:
        plt.close(fig)
    return out


def bandwidth_plot(
    df: pd.DataFrame,
    x: str,
    out_path: str | Path,
    title: str,
    peak_gbs: float | None = None,
    line_by: str | Sequence[str] = ("kernel", "variant"),
    x_label: str | None = None,
    gpu_time: bool = False,
) -> Path:
    """Achieved GB/s against shape column `x`, one line per `line_by` combination. `gpu_time`:
    a second panel beside it with GB/s by the GPU's own time per call (`gpu_us`, CUPTI: what
    the kernel costs) where the first is by wall time per call (`us`: what a caller waits)."""
    line_by = _as_tuple(line_by)
    needed = ["gbs", x, *line_by] + (["peak_gbs"] if peak_gbs is None else [])
    _require(df, needed, "bandwidth_plot")
    if peak_gbs is None:
        median = pd.to_numeric(df["peak_gbs"], errors="coerce").median()
        peak_gbs = None if pd.isna(median) else float(median)

    data = _latest(df.dropna(subset=["gbs", x]), [*line_by, x])
    if data.empty:
        raise ValueError(f"bandwidth_plot: no rows with both 'gbs' and {x!r}")
    panels = [("gbs", "GB/s by wall time per call (us)")]
    if gpu_time and "gpu_us" in data and pd.to_numeric(data["gpu_us"], errors="coerce").notna().any():
        data = data.copy()
        data["gpu_gbs"] = pd.to_numeric(data["bytes"], errors="coerce") / pd.to_numeric(data["gpu_us"], errors="coerce") / 1e3
        panels.append(("gpu_gbs", "GB/s by GPU time per call (gpu_us, CUPTI)"))

    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    n_lines = data.groupby(list(line_by)).ngroups
    for ax, (column, y_label) in zip(axes[0], panels):
        for key, grp in data.groupby(list(line_by), sort=True):
            grp = grp.dropna(subset=[column]).sort_values(x)
            ax.plot(grp[x], grp[column], marker="o", label=_label(key))
        if peak_gbs is not None:
            ax.axhline(peak_gbs, color="black", linestyle="--", linewidth=1,
                       label=f"measured peak {peak_gbs:.0f} GB/s")
        _x_axis(ax, data, x)
        ax.set_xlabel(x_label if x_label is not None else x)
        ax.set_ylabel(y_label if len(panels) > 1 else "GB/s")
        ax.set_title(title if len(panels) == 1 else f"{title}\n{y_label}", fontsize="medium")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.4)
    _say_if_runs_mix(fig, data)
    if n_lines > 6:  # many lines would cover the data: move the legend out
        axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
    else:
        axes[0][-1].legend(loc="best", fontsize="small")
    return _save(fig, out_path)


def _x_axis(ax, data: pd.DataFrame, x: str) -> None:
    # Shape sweeps are usually powers of two: a log2 axis spaces them evenly, one tick a value.
    # Anything else (e.g. bytes moved, which differ per kernel) gets a plain log axis.
    xs = sorted(pd.to_numeric(data[x], errors="coerce").dropna().unique())
    if xs and xs[0] > 0 and xs[-1] / xs[0] > 8:
        powers_of_two = all(float(v).is_integer() and (int(v) & (int(v) - 1)) == 0 for v in xs)
        if powers_of_two and len(xs) <= 16:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{v:g}" for v in xs])
            ax.minorticks_off()
        else:
            ax.set_xscale("log")


def fused_unfused_plot(
    df: pd.DataFrame,
    group: str | Sequence[str],
    out_path: str | Path,
    title: str,
    baseline_variant: str | Sequence[str],
    x_label: str = "",
) -> Path:
    """Grouped bars of time per call (`us`), one bar per variant, with speedups vs the baseline:
    in each group, the first of `baseline_variant` (one name or several) that it has."""
    baselines = _as_tuple(baseline_variant)
    group = _as_tuple(group)
    _require(df, ["us", "variant", *group], "fused_unfused_plot")
    data = _latest(df.dropna(subset=["us"]), [*group, "variant"])
    if data.empty:
        raise ValueError("fused_unfused_plot: no rows with a 'us' value")

    # Fixed variant order and colour: baseline first, then order of appearance.
    variants = list(dict.fromkeys(data["variant"].astype(str)))
    for name in reversed(baselines):
        if name in variants:
            variants.remove(name)
            variants.insert(0, name)
    colours = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    groups = list(data.groupby(list(group), sort=True))
    labelled: set[str] = set()  # one legend entry per variant

    width = 0.8 / len(variants)
    fig_w = min(16.0, max(6.0, 2.0 + 0.5 * len(groups) * len(variants)))
    fig, ax = plt.subplots(figsize=(fig_w, 5))
    for gi, (key, grp) in enumerate(groups):
        us_by_variant = dict(zip(grp["variant"].astype(str), grp["us"].astype(float)))
        baseline = next((b for b in baselines if b in us_by_variant), None)
        base = us_by_variant.get(baseline)
        for vi, variant in enumerate(variants):
            if variant not in us_by_variant:
                continue
            us = us_by_variant[variant]
            pos = gi - 0.4 + width * (vi + 0.5)
            ax.bar(pos, us, width=width, color=colours[variant],
                   label=None if variant in labelled else variant)
            labelled.add(variant)
            if base is not None and variant != baseline and us > 0:
                ax.text(pos, us, f"{base / us:.2f}x", ha="center", va="bottom", fontsize="small")

    _say_if_runs_mix(fig, data)
    crowded = len(groups) > 4  # slant long group labels so they do not overlap
    ax.set_xticks(range(len(groups)), [_label(k) for k, _ in groups],
                  rotation=30 if crowded else 0, ha="right" if crowded else "center")
    ax.set_xlabel(x_label or " / ".join(group))
    ax.set_ylabel("time per call (us)")
    ax.set_title(title)
    ax.margins(y=0.12)  # head room for the ratio labels
    ax.grid(True, axis="y", alpha=0.4)
    ax.legend(loc="best", fontsize="small")
    return _save(fig, out_path)


def decode_plot(df: pd.DataFrame, out_path: str | Path, title: str) -> Path:
    """End-to-end decode tok/s: one group of bars per (model, qtype, depth), a bar per (variant,
    mode) from the newest run that measured it (one command: a `--peer llama.cpp` run gives
    lathe's and llama.cpp's bars together), the mean of the run's rounds with their range as a
    black line. The runs a group's bars come from are named under it. A group with no llama.cpp
    bar gets ANCHORS.md's figure as a mark labelled as another run's (harness.anchors, same
    device only). The roofline: the row's bytes per token at its measured peak."""
    from harness.anchors import llama_cpp_tok_s
    from harness.peers import VARIANT as PEER

    keys = ["model", "qtype", "depth"]
    _require(df, [*keys, "variant", "mode", "decode_tok_s", "bytes", "peak_gbs", "device"], "decode_plot")
    data = _newest_run_per(df.dropna(subset=["decode_tok_s"]), [*keys, "device", "variant", "mode"])
    bars = list(dict.fromkeys(zip(data["variant"].astype(str), data["mode"].astype(str))))
    bars.sort(key=lambda bar: bar[0] == PEER)  # the peer's bar last in every group
    variants, modes = list(dict.fromkeys(v for v, _ in bars)), list(dict.fromkeys(m for _, m in bars))
    groups = list(data.groupby(keys, sort=True))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(min(18.0, 3.0 + 0.35 * len(groups) * len(bars)), 5.5))
    marked = set()
    for gi, ((model, qtype, depth), grp) in enumerate(groups):
        for bi, bar in enumerate(bars):
            tok_s = grp[(grp.variant.astype(str) == bar[0]) & (grp["mode"].astype(str) == bar[1])].decode_tok_s
            if tok_s.empty:
                continue
            x = gi - 0.4 + width * (bi + 0.5)
            peer = bar[0] == PEER
            ax.bar(x, tok_s.mean(), width=width, color="0.35" if peer else f"C{variants.index(bar[0]) % 10}",
                   hatch="" if peer else ("", "//", "..", "xx", "--", "++")[modes.index(bar[1]) % 6],
                   edgecolor="white", label=None if bar in marked else f"{bar[0]} {bar[1]}")
            if len(tok_s) > 1:  # rounds of the run: their range
                ax.vlines(x, tok_s.min(), tok_s.max(), colors="k", linewidth=1)
            marked.add(bar)
        row = grp.iloc[-1]
        marks = [("roofline (weights + KV at the measured peak)", float(row["peak_gbs"]) * 1e9 / float(row["bytes"]), "r", "--")]
        if not (grp.variant.astype(str) == PEER).any():
            marks.append(("llama.cpp, ANCHORS.md (another run)", llama_cpp_tok_s(str(row["device"]), model, qtype, depth),
                          "k", ":"))
        for name, tok_s, colour, style in marks:
            if tok_s and tok_s == tok_s:
                ax.hlines(tok_s, gi - 0.45, gi + 0.45, colors=colour, linestyles=style, linewidth=2,
                          label=None if name in marked else name)
                marked.add(name)
    ax.set_xticks(range(len(groups)), [f"{m} {q}" + (f"\n@ depth {d}" if d else "") + "\n" + _run_label(g, "\n", "\n")
                                       for (m, q, d), g in groups], fontsize="small")
    ax.set_yscale("log")
    ax.set_ylabel("decode tok/s (batch 1, log scale)")
    ax.set_title(title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
    return _save(fig, out_path)


def quality_plot(df: pd.DataFrame, path: str | Path, title: str) -> Path:
    """quality.csv: each (model, text, n_ctx)'s newest run, perplexity per variant beside
    llama.cpp's (left) and each variant's mean KL divergence from the reference (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = df[df["benchmark"] == "quality"]
    groups = list(df.groupby(["model", "text", "n_ctx"], sort=True))
    fig, axes = plt.subplots(max(1, len(groups)), 2, figsize=(11, 3 + 2.5 * len(groups)), squeeze=False)
    for (key, g), (left, right) in zip(groups, axes):
        newest = g[g["date"] == g["date"].max()]
        left.bar(newest["variant"], newest["ppl"], yerr=newest["ppl_err"], color="tab:blue")
        left.set_title(f"{key[0]} on {key[1]} (n_ctx {key[2]}): perplexity", fontsize=9)
        left.tick_params(axis="x", rotation=30, labelsize=8)
        kl = newest.dropna(subset=["kl_mean"])
        if kl.empty:  # only the reference ran (the kernel variants refused the model)
            right.text(0.5, 0.5, "no kernel variant ran this model", ha="center", va="center",
                       transform=right.transAxes, fontsize=9)
            right.set_xticks([])
            right.set_yticks([])
        right.bar(kl["variant"], kl["kl_mean"], color="tab:orange")
        right.set_title("mean KL(reference || variant), nats", fontsize=9)
        right.tick_params(axis="x", rotation=30, labelsize=8)
        right.axhline(1e-3, color="grey", linestyle="--", linewidth=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _not_grey(i: int) -> str:
    """Matplotlib's i-th cycle colour, its grey (C7) skipped: grey is the peer's."""
    i %= 9
    return f"C{i + (i >= 7)}"


def serve_lines(df: pd.DataFrame) -> dict[tuple, pd.DataFrame]:
    """serve_plot's lines: {(model, qtype, prompt, gen, variant, option set): its rows}, a model's
    rows of the newest commit that served it beside llama-batched-bench (of the newest commit that
    served it, where none did: an A/B run without the peer does not hide the ratios' session), each
    batch size from the newest run that measured it (all its rounds); the option set is `lathe
    serve --ab`'s (the peer's is '')."""
    keys = ["model", "qtype", "prompt", "gen"]
    _require(df, [*keys, "variant", "batch", "decode_tok_s", "shared", "mixed"], "serve_plot")
    data = df[(df.shared.fillna(0) == 0) & (df.mixed.fillna(0) == 0)].dropna(subset=["decode_tok_s"])
    arm = (data["options"] if "options" in data else pd.Series("", index=data.index)).fillna("").astype(str)
    data = data.assign(arm=arm.where(data.variant != "llama.cpp", ""))  # the peer runs under no option set
    if "git_sha" in data and "date" in data:
        group = [data[k] for k in keys]
        # a key's candidate rows: those of the commits that ran the peer on it, where any did
        is_peer = data.variant == "llama.cpp"
        with_peer = is_peer.groupby([*group, data.git_sha], dropna=False).transform("any")
        candidate = with_peer | ~with_peer.groupby(group, dropna=False).transform("any")
        newest = data.date.where(candidate).groupby(group, dropna=False).transform("max")
        sha = data.git_sha.where(candidate & (data.date == newest)).groupby(group, dropna=False).transform("first")
        data = data[data.git_sha == sha]
    data = _newest_run_per(data, [*keys, "variant", "arm", "batch"])
    return {key: rows for key, rows in data.groupby([*keys, "variant", "arm"], sort=True)}


def serve_plot(df: pd.DataFrame, out_path: str | Path, title: str) -> Path:
    """Many sequences at once: decode tok/s (all sequences together) against the batch size, a
    line per serve_lines' key, the rounds' mean with their range; llama-batched-bench's in grey."""
    lines = serve_lines(df)
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    models = sorted({key[:4] for key in lines})
    for i, ((model, qtype, prompt, gen, variant, options), rows) in enumerate(lines.items()):
        by_batch = rows.groupby("batch").decode_tok_s
        mean, low, high = by_batch.mean(), by_batch.min(), by_batch.max()
        peer = variant == "llama.cpp"
        # a marker per model: past nine lines the colours come round again
        ax.errorbar(mean.index, mean.values, yerr=[mean - low, high - mean],
                    marker="os^Dv"[models.index((model, qtype, prompt, gen)) % 5], capsize=3,
                    color="0.4" if peer else _not_grey(i + models.index((model, qtype, prompt, gen))),
                    linestyle="--" if peer else "-",
                    label=f"{model} {qtype} pp{int(prompt)}+tg{int(gen)}: {variant}" + (f" ({options})" if options else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences at once (batch)")
    ax.set_ylabel("decode tok/s, all sequences")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper left")
    _say_if_runs_mix(fig, pd.concat(lines.values()) if lines else pd.DataFrame())
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out_path
