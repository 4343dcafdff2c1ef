"""harness.tools.gemv_report: the GEMV targets read from a committed benchmark run (the H200's, 24caf7e)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.tools.gemv_report import m1_table, m_table, main, markdown, target

CSV = Path(__file__).resolve().parent.parent / "results" / "nvidia-h200" / "gemv.csv"


def run_rows() -> pd.DataFrame:
    df = pd.read_csv(CSV, dtype={"git_sha": str})
    return df[df.git_sha == "24caf7e"]


def test_targets_by_shape():
    assert target(4096, 14336) == target(128256, 4096) == 85.0
    assert target(4096, 4096) == target(6144, 4096) == 75.0
    assert target(151936, 1024) == 50.0 and target(777, 1000) is None


def test_m1_table_reads_gpu_time_against_the_peak():
    table = m1_table(run_rows()).set_index(["kernel", "variant", "N", "K"])
    row = table.loc[("gemv_q8_0", "v3", 128256, 4096)]
    # bytes / gpu_us over the same process's peak: 2 * 128256 * 4096 * 34/32 bytes + X, Y in 130.7 us
    assert abs(row["% peak (GPU)"] - 104.1) < 0.1 and row.met == "yes" and row["wall met"] == "yes"
    assert table.loc[("gemv_q4_0", "v3", 1024, 3072)].met == "no"
    fused = table.loc[("qkv_q4_0", "fused-v3", 6144, 4096)]  # QKV's N is the sum of its three matrices
    assert fused["target %"] == 75.0 and fused.met == "no"
    assert table.loc[("mlx.matmul-fp16", "fp16", 4096, 4096)].met == ""  # peers are shown, not judged


def test_m_table_compares_rows_with_one_row():
    table = m_table(run_rows()).set_index(["kernel", "N", "K", "M"])
    assert set(table.index.get_level_values("M")) == {2, 3, 4}
    row = table.loc[("linear_q4_0", 128256, 4096, 2)]
    assert abs(row["over M = 1"] - 76.142 / 72.828) < 0.01 and row["met (<= 1.3)"] == "yes"


def test_a_run_without_batched_rows_gives_an_empty_m_table():
    """A --quick bench (M = 1 rows alone) reads as an empty M table, not an error."""
    run = run_rows()
    table = m_table(run[run.benchmark != "gemv-batched"])
    assert table.empty and "over M = 1" in table.columns


def test_report_prints_markdown_and_refuses_a_run_without_gpu_time(capsys, tmp_path):
    assert main([str(CSV), "--sha", "24caf7e"]) == 0
    out = capsys.readouterr().out
    assert "| gemv_q4_0 | v3 | 14336 | 4096 |" in out and "| over M = 1 |" in out
    run_rows().assign(git_sha="5e79645").to_csv(tmp_path / "sha.csv", index=False)
    assert main([str(tmp_path / "sha.csv")]) == 0  # a sha that reads as a number (5e79645 = inf)
    assert "run 5e79645 (" in capsys.readouterr().out
    untimed = run_rows().assign(gpu_us=float("nan"))
    untimed.to_csv(tmp_path / "g.csv", index=False)
    assert main([str(tmp_path / "g.csv")]) == 1
    assert markdown(pd.DataFrame({"a": [1.5, None]})) == "| a |\n| --- |\n| 1.5 |\n|  |"
