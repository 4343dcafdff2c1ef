"""CPU tests for harness.results and harness.plots (no GPU, no kernels)."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.axes
import matplotlib.figure
import pandas as pd
import pytest

from harness import plots, results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rope_row(**over) -> dict:
    row = {
        "benchmark": "rope", "kernel": "rope_msl", "variant": "fused", "backend": "mlx",
        "device": "NVIDIA H200", "us": 12.5, "gbs": 812.25, "pct_peak": 19.6,
        "peak_gbs": 4140.0, "bytes": 1048576, "mlx_version": "0.32.4",
        "git_sha": "abc1234", "date": "2026-11-22T01:02:03Z",
        "seq": 128, "head_dim": 64, "n_heads": 32, "n_kv_heads": 8,
    }
    row.update(over)
    return row


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1024


# --- columns --------------------------------------------------------------

def test_common_columns_order():
    assert results.COMMON_COLUMNS == [
        "benchmark", "kernel", "variant", "backend", "device", "us", "us_min", "us_max",
        "gbs", "pct_peak", "peak_gbs", "bytes", "flops", "launches", "repeats", "rel_err",
        "compile_s", "host_us", "gpu_us", "gpu_kernels", "mlx_version", "git_sha", "date", "options",
    ]


def test_a_file_without_the_options_column_is_upgraded_and_rows_name_their_options(tmp_path):
    from kernels import options

    path = tmp_path / "rope.csv"
    old = [c for c in results.columns("rope") if c != "options"]
    path.write_text(",".join(old) + "\n")
    with options.use(seams=True, attn_partition=128):
        meta = results.run_metadata()
    assert meta["options"] == "seams=on,attn_partition=128"
    assert results.run_metadata()["options"] == ""
    results.append_rows(path, "rope", [_rope_row(**meta)])
    df = results.read_results(path)
    assert list(df.columns) == results.columns("rope") and df.options[0] == "seams=on,attn_partition=128"


@pytest.mark.parametrize("family, shape", [
    ("rope", ["seq", "head_dim", "n_heads", "n_kv_heads"]),
    ("gemv", ["M", "N", "K"]),
    ("attention", ["batch", "ctx", "n_heads", "n_kv_heads", "head_dim", "block_size", "tokens", "pos"]),
    ("decode", ["model", "qtype", "mode", "depth", "prompt", "gen", "prefill_tok_s",
                "decode_tok_s", "ms_per_token", "dispatches_per_token", "pct_roofline",
                "round", "x_llama_cpp", "peer_build", "error"]),
    ("peak", ["nbytes"]),
])
def test_columns_per_family(family, shape):
    cols = results.columns(family)
    assert cols == results.COMMON_COLUMNS + shape
    assert len(cols) == len(set(cols))  # decode's "variant" is not repeated


def test_columns_unknown_family():
    with pytest.raises(ValueError, match="rope"):
        results.columns("nope")


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "nvidia-h200"), ("cpu", "cpu"), ("  Apple M3 Max (GPU) ", "apple-m3-max-gpu"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
])
def test_device_slug(name, slug):
    assert results.device_slug(name) == slug


def test_results_dir(tmp_path):
    assert results.results_dir(tmp_path, "NVIDIA H200") == tmp_path / "results" / "nvidia-h200"


# --- metadata -------------------------------------------------------------

def test_run_metadata():
    meta = results.run_metadata()
    assert set(meta) == {"mlx_version", "git_sha", "date", "options"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"])
    assert meta["git_sha"] and meta["mlx_version"]


def test_git_sha_outside_repo(tmp_path):
    assert results.git_sha(tmp_path) == "unknown"


# --- append / read --------------------------------------------------------

def test_append_rows_creates_then_appends(tmp_path):
    path = tmp_path / "deep" / "dir" / "rope.csv"
    first = _rope_row()
    second = _rope_row(variant="unfused", us=30.0, rel_err=1e-6, git_sha="0123456")
    assert results.append_rows(path, "rope", [first]) == path
    results.append_rows(path, "rope", [second])

    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(results.columns("rope"))
    assert sum(line.startswith("benchmark,") for line in lines) == 1  # header written once

    df = results.read_results(path)
    assert list(df.columns) == results.columns("rope")
    assert len(df) == 2
    for i, row in enumerate([first, second]):
        for key, value in row.items():
            assert df.loc[i, key] == value, key
    assert df["git_sha"].tolist() == ["abc1234", "0123456"]  # kept as text
    assert pd.isna(df.loc[0, "rel_err"]) and df.loc[1, "rel_err"] == 1e-6
    for col in ("us_min", "us_max", "flops", "launches", "repeats", "compile_s"):
        assert df[col].isna().all(), col


def test_append_rows_schema_mismatch(tmp_path):
    path = tmp_path / "rope.csv"
    path.write_text("benchmark,kernel,us\nrope,k,1.0\n")
    with pytest.raises(ValueError, match="schema changed"):
        results.append_rows(path, "rope", [_rope_row()])
    assert path.read_text() == "benchmark,kernel,us\nrope,k,1.0\n"  # left untouched


def test_append_rows_upgrades_a_file_of_an_older_schema(tmp_path):
    """Columns added to a schema since a file was written (optional ones only) are added to it,
    empty in its old rows; the old rows keep every value."""
    path = tmp_path / "decode.csv"
    new = ["gpu_kernels", "options", "round", "x_llama_cpp", "peer_build", "error"]
    old_cols = [c for c in results.columns("decode") if c not in new]
    old_row = dict(zip(old_cols, ["decode", "llama3-8b", "fused", "cuda", "NVIDIA H200", "2600.0", "", "", "1500.5",
                                  "36.1", "4150.0", "4000000000", "", "", "3", "", "0.5", "", "", "0.32.4",
                                  "abc1234", "2026-11-22T00:00:00Z", "llama3-8b", "q4_0", "compiled", "0", "16",
                                  "128", "900.0", "384.6", "2.6", "290", "36.1"]))
    path.write_text(",".join(old_cols) + "\n" + ",".join(old_row[c] for c in old_cols) + "\n")
    row = {**{c: v for c, v in old_row.items() if v}, "date": "2026-11-23T00:00:00Z", "round": 1,
           "x_llama_cpp": 1.1, "peer_build": "0c1e570 (0)"}
    results.append_rows(path, "decode", [row])
    df = results.read_results(path)
    assert list(df.columns) == results.columns("decode")
    assert df["decode_tok_s"].tolist() == [384.6, 384.6] and df["git_sha"].tolist() == ["abc1234"] * 2
    assert df.loc[0, new].isna().all() and df.loc[1, "peer_build"] == "0c1e570 (0)"
    # a missing required column is still a schema change, and the file is left alone
    before = path.read_text()
    with pytest.raises(ValueError, match="schema changed"):
        results.append_rows(path, "rope", [_rope_row()])
    assert path.read_text() == before


def test_append_rows_empty_is_noop(tmp_path):
    results.append_rows(tmp_path / "gemv.csv", "gemv", [])
    assert not (tmp_path / "gemv.csv").exists()


def test_append_rows_other_family_file(tmp_path):
    path = results.append_rows(tmp_path / "r.csv", "rope", [_rope_row()])
    with pytest.raises(ValueError, match="schema changed"):
        peak_row = {k: v for k, v in _rope_row().items() if k in results.COMMON_COLUMNS}
        results.append_rows(path, "peak", [{**peak_row, "nbytes": 1}])


def test_append_rows_unknown_key(tmp_path):
    with pytest.raises(ValueError, match="bogus"):
        results.append_rows(tmp_path / "r.csv", "rope", [_rope_row(bogus=1)])
    assert not (tmp_path / "r.csv").exists()


def test_append_rows_missing_required(tmp_path):
    row = _rope_row()
    del row["gbs"]
    with pytest.raises(ValueError, match="gbs"):
        results.append_rows(tmp_path / "r.csv", "rope", [row])


# --- plots ----------------------------------------------------------------

def _sweep_frame() -> pd.DataFrame:
    rows = []
    for variant, scale in (("fused", 1.0), ("unfused", 0.4)):
        for seq in (128, 512, 2048, 8192):
            rows.append(_rope_row(variant=variant, seq=seq, gbs=scale * seq / 4,
                                  us=1000 / scale / 100 * seq / 128))
    # A stale duplicate that the newer row above must win over.
    rows.append(_rope_row(variant="fused", seq=128, gbs=9999.0, us=0.001,
                          date="2020-01-01T00:00:00Z"))
    return pd.DataFrame(rows)


@pytest.fixture
def captured_text(monkeypatch):
    """Record strings written with Axes.text (the ratio labels)."""
    seen: list[str] = []
    original = matplotlib.axes.Axes.text

    def spy(self, x, y, s, *args, **kwargs):
        seen.append(s)
        return original(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", spy)
    return seen


def test_bandwidth_plot(tmp_path):
    out = plots.bandwidth_plot(_sweep_frame(), "seq", tmp_path / "bw.png", "RoPE bandwidth")
    assert out == tmp_path / "bw.png"
    _assert_png(out)


def test_bandwidth_plot_explicit_peak_and_line_by(tmp_path):
    df = _sweep_frame().drop(columns=["peak_gbs"])
    out = plots.bandwidth_plot(df, "seq", tmp_path / "bw2.png", "t", peak_gbs=4000.0,
                               line_by="variant", x_label="sequence length")
    _assert_png(out)


def test_fused_unfused_plot(tmp_path, captured_text):
    df = _sweep_frame()
    out = plots.fused_unfused_plot(df, ("seq", "head_dim"), tmp_path / "fu.png", "RoPE",
                                   baseline_variant="unfused")
    _assert_png(out)
    # fused is 2.5x faster than unfused in every group; the stale row is ignored.
    assert captured_text == ["2.50x"] * 4


def test_fused_unfused_plot_no_baseline_in_group(tmp_path, captured_text):
    df = _sweep_frame()
    df = df[~((df.seq == 8192) & (df.variant == "unfused"))]
    plots.fused_unfused_plot(df, "seq", tmp_path / "fu.png", "RoPE", baseline_variant="unfused")
    assert captured_text == ["2.50x"] * 3


@pytest.mark.parametrize("call", [
    lambda df, p: plots.bandwidth_plot(df, "seq", p, "t"),
    lambda df, p: plots.fused_unfused_plot(df, "seq", p, "t", baseline_variant="unfused"),
])
def test_plots_reject_empty_and_missing(tmp_path, call):
    with pytest.raises(ValueError, match="no rows"):
        call(pd.DataFrame(columns=results.columns("rope")), tmp_path / "e.png")
    with pytest.raises(ValueError, match="missing column"):
        call(_sweep_frame().drop(columns=["seq"]), tmp_path / "m.png")
    assert not list(tmp_path.iterdir())


def _decode_rows(run: str, date: str, device: str = "NVIDIA H200", peer: float | None = None, **over) -> list[dict]:
    rows = [dict(dict(model="llama3-8b", qtype="q4_0", depth=0, variant=v, mode=mode, decode_tok_s=t, bytes=4e9,
                      peak_gbs=4000.0, device=device, git_sha=run, date=date, round=rnd), **over)
            for v, t in (("reference", 190.0), ("fused", 250.0)) for mode in ("step", "compiled")
            for rnd in (1, 2)]
    if peer:
        rows += [dict(rows[0], variant="llama.cpp", mode="llama-bench", decode_tok_s=peer + rnd, round=rnd)
                 for rnd in (1, 2)]
    return rows


@pytest.fixture
def marks(monkeypatch):
    """The horizontal marks (tok/s, colour) and the bars (height) a decode plot draws."""
    seen = {"marks": [], "bars": []}
    hlines, bar = matplotlib.axes.Axes.hlines, matplotlib.axes.Axes.bar

    def spy_hlines(self, y, *args, **kwargs):
        seen["marks"].append((round(float(y), 1), kwargs.get("colors")))
        return hlines(self, y, *args, **kwargs)

    def spy_bar(self, x, height, *args, **kwargs):
        seen["bars"].append(round(float(height), 1))
        return bar(self, x, height, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "hlines", spy_hlines)
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", spy_bar)
    return seen


def test_decode_plot_takes_each_bar_from_its_newest_run(tmp_path, marks, monkeypatch):
    """Each bar comes from the newest run that measured it, its rounds averaged; llama.cpp's bar
    from a --peer run stands for the figure (ANCHORS.md's is not drawn); the runs a group's bars
    come from are named under it."""
    ticks = []
    original = matplotlib.axes.Axes.set_xticks
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks",
                        lambda self, t, labels=None, **kw: ticks.extend(labels) or original(self, t, labels, **kw))
    old = _decode_rows("old1234", "2026-11-21T00:00:00Z", peer=300.0)
    new = [r for r in _decode_rows("new5678", "2026-11-23T00:00:00Z", peer=340.0) if r["variant"] != "reference"]
    for r in new:
        r["decode_tok_s"] *= 1 if r["variant"] == "llama.cpp" else 2
    _assert_png(plots.decode_plot(pd.DataFrame(old + new), tmp_path / "d.png", "decode"))
    # fused (step, compiled) and llama.cpp from the new run, reference (step, compiled) from the old
    assert marks["bars"] == [190.0, 190.0, 500.0, 500.0, 341.5]
    assert marks["marks"] == [(1000.0, "r")]  # the roofline only: llama.cpp measured in a run
    assert ticks == ["llama3-8b q4_0\nold1234\n11-21 00:00\nnew5678\n11-23 00:00"]


def test_decode_plot_falls_back_to_anchors_only_where_the_run_has_no_peer(tmp_path, marks):
    rows = (_decode_rows("abc1234", "2026-11-22T00:00:00Z")
            + _decode_rows("abc1234", "2026-11-22T00:00:00Z", device="NVIDIA H100 80GB HBM3", model="llama2-7b"))
    _assert_png(plots.decode_plot(pd.DataFrame(rows), tmp_path / "d.png", "decode"))
    # ANCHORS.md's Llama-3-8B Q4_0 figure on its own device (the H200) only
    assert sorted(marks["marks"]) == [(348.0, "k"), (1000.0, "r"), (1000.0, "r")]


def test_plots_say_when_their_rows_come_from_several_runs(tmp_path, monkeypatch):
    notes = []
    original = matplotlib.figure.Figure.text

    def spy(self, x, y, s, *args, **kwargs):
        notes.append(s)
        return original(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "text", spy)
    one_run = _sweep_frame()
    one_run = one_run[one_run.date != "2020-01-01T00:00:00Z"]
    plots.bandwidth_plot(one_run, "seq", tmp_path / "a.png", "t")
    assert notes == []
    mixed = pd.concat([one_run, pd.DataFrame([_rope_row(seq=16384, git_sha="fff0000",
                                                        date="2026-11-23T05:00:00Z")])])
    plots.bandwidth_plot(mixed, "seq", tmp_path / "b.png", "t")
    plots.fused_unfused_plot(mixed, "seq", tmp_path / "c.png", "t", baseline_variant="unfused")
    assert len(notes) == 2 and all("rows of 2 runs" in n and "fff0000" in n and "abc1234" in n for n in notes)


def test_serve_lines_take_a_models_newest_commit_each_batch_newest_run_and_each_option_set():
    """serve_plot's lines: a model's rows of its newest commit only (an older commit's batch 64 is
    left out), each batch from the newest run that has it (both rounds), a line per option set of
    `lathe serve --ab`, the peer's under none."""
    def row(sha, date, variant, batch, tok_s, options="", round_=1, model="m"):
        return dict(model=model, qtype="Q8_0", prompt=128, gen=128, shared=0, mixed=0, variant=variant,
                    batch=batch, decode_tok_s=tok_s, options=options, git_sha=sha, date=date, round=round_)

    df = pd.DataFrame([
        row("old", "2026-11-28T00:00:00Z", "fused", 64, 1.0),
        row("new", "2026-11-29T01:00:00Z", "megafused", 8, 10.0),
        row("new", "2026-11-29T02:00:00Z", "megafused", 8, 20.0),
        row("new", "2026-11-29T02:00:00Z", "megafused", 8, 22.0, round_=2),
        row("new", "2026-11-29T02:00:00Z", "megafused", 8, 30.0, options="serve_mega_rows=8"),
        row("new", "2026-11-29T01:00:00Z", "megafused", 1, 5.0),
        row("new", "2026-11-29T02:00:00Z", "llama.cpp", 8, 15.0, options="serve_mega_rows=8"),
        row("x", "2026-11-20T00:00:00Z", "fused", 8, 7.0, model="other"),
    ])
    lines = plots.serve_lines(df)
    mega = lines[("m", "Q8_0", 128, 128, "megafused", "")]
    assert sorted(mega.decode_tok_s) == [5.0, 20.0, 22.0]
    assert list(lines[("m", "Q8_0", 128, 128, "megafused", "serve_mega_rows=8")].decode_tok_s) == [30.0]
    assert list(lines[("m", "Q8_0", 128, 128, "llama.cpp", "")].decode_tok_s) == [15.0]
    assert list(lines[("other", "Q8_0", 128, 128, "fused", "")].decode_tok_s) == [7.0]
    assert not any(key[4] == "fused" and key[0] == "m" for key in lines)  # the old commit's row


def test_serve_lines_keep_the_peers_session_past_a_newer_run_without_it():
    """A newer commit's A/B without llama-batched-bench does not hide the newest commit that ran
    the peer on that model; a model never served beside the peer keeps its newest commit."""
    def row(sha, date, variant, batch, tok_s, options="", model="m"):
        return dict(model=model, qtype="Q4_0", prompt=128, gen=128, shared=0, mixed=0, variant=variant,
                    batch=batch, decode_tok_s=tok_s, options=options, git_sha=sha, date=date, round=1)

    df = pd.DataFrame([
        row("peer", "2026-11-30T02:00:00Z", "fused", 8, 2000.0),
        row("peer", "2026-11-30T02:00:00Z", "fused", 32, 6400.0),
        row("peer", "2026-11-30T02:00:00Z", "llama.cpp", 8, 1300.0),
        row("ab", "2026-11-30T03:00:00Z", "fused", 8, 2100.0),
        row("ab", "2026-11-30T03:00:00Z", "fused", 8, 2300.0, options="qmm_rows8=on"),
        # the peer ran in a commit of another model only: model n keeps its newest commit
        row("ab", "2026-11-30T03:00:00Z", "llama.cpp", 8, 900.0, model="o"),
        row("old", "2026-11-29T00:00:00Z", "fused", 8, 1.0, model="n"),
        row("ab", "2026-11-30T03:00:00Z", "fused", 8, 2.0, model="n"),
    ])
    lines = plots.serve_lines(df)
    assert sorted(lines[("m", "Q4_0", 128, 128, "fused", "")].decode_tok_s) == [2000.0, 6400.0]
    assert list(lines[("m", "Q4_0", 128, 128, "llama.cpp", "")].decode_tok_s) == [1300.0]
    assert ("m", "Q4_0", 128, 128, "fused", "qmm_rows8=on") not in lines
    assert list(lines[("n", "Q4_0", 128, 128, "fused", "")].decode_tok_s) == [2.0]
