"""harness.tools.attention_report: the attention targets read from a committed benchmark run (the H100's,
4dff975, whose rows include an A/B pass under other options that the report must leave out)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.tools.attention_report import decode_table, default_rows, main, mixed_table, prefill_table

CSV = Path(__file__).resolve().parent.parent / "results" / "nvidia-h100-80gb-hbm3" / "attention.csv"


def run_rows() -> pd.DataFrame:
    df = pd.read_csv(CSV, dtype={"git_sha": str, "options": str})
    return df[df.git_sha == "4dff975"]


def test_default_rows_leave_out_other_options_and_repeats():
    run = run_rows()
    assert (run.options.fillna("") != "").any()  # the A/B rows are there ...
    rows = default_rows(run)
    assert (rows.options.fillna("") == "").all()  # ... and left out
    assert not rows.duplicated(["benchmark", "kernel", "variant", "batch", "ctx", "tokens", "pos"]).any()
    one = rows[(rows.benchmark == "attention-decode-b1") & (rows.kernel == "paged_v2")
               & (rows.variant == "llama3-8b") & (rows.ctx == 8192)].iloc[0]
    assert abs(one["% GPU"] - 100 * one.bytes / one.gpu_us / 1e3 / one.peak_gbs) < 1e-9


def test_decode_table_judges_the_best_of_ours_from_8192_tokens():
    table = decode_table(run_rows()).set_index(["rows", "heads", "ctx"])
    qwen = table.loc[("b1", "qwen3-0.6b", 32768)]
    assert qwen["met (>= 90)"] == "yes" and qwen["paged_v2 %"] >= 90
    llama = table.loc[("b1", "llama3-8b", 8192)]
    assert llama["met (>= 90)"] == ("yes" if max(llama["flash_decode %"], llama["paged_v2 %"]) >= 90 else "no")
    assert table.loc[("b1", "llama3-8b", 512)]["met (>= 90)"] == ""  # no floor below 8192
    assert set(table["ahead by wall"]) <= {"yes", "no"}


def test_mixed_and_prefill_tables():
    mixed = mixed_table(run_rows())
    assert set(mixed["rows"]) == {"b8-mixed", "b32-mixed"}
    assert (mixed[mixed["longest ctx"] == 8192]["met (>= 90)"] == "").all()
    prefill = prefill_table(run_rows()).set_index(["heads", "tokens", "pos", "kernel"])
    row = prefill.loc[("llama3-8b", 2048, 0, "tiled")]
    assert abs(row["sdpa / ours (GPU)"] - row["sdpa gpu_us"] / row["gpu_us"]) < 0.01
    assert prefill.loc[("llama3-8b", 16, 4096, "tiled")]["met (>= 0.8)"] == ""  # a 16-token prompt has no floor


def test_report_prints_markdown_and_refuses_a_run_without_gpu_time(capsys, tmp_path):
    assert main([str(CSV), "--sha", "4dff975"]) == 0
    out = capsys.readouterr().out
    assert "| b1 | llama3-8b | 32768 |" in out and "| sdpa / ours (GPU) |" in out
    run_rows().assign(gpu_us=float("nan")).to_csv(tmp_path / "a.csv", index=False)
    assert main([str(tmp_path / "a.csv")]) == 1
