"""harness.tools.qmm_report: the quantized GEMM's target read from a committed sweep (the H200's, a5c36c6)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.tools.qmm_report import main, rule_label, sweep_table

CSV = Path(__file__).resolve().parent.parent / "results" / "nvidia-h200" / "gemv.csv"


def run_rows() -> pd.DataFrame:
    df = pd.read_csv(CSV, dtype={"git_sha": str, "options": str})
    return df[df.git_sha == "d1c7394"]


def test_rule_labels_follow_qmm_by_shape():
    assert rule_label("q4_0", 16, 28672, 4096) == "qmm NB4-WN2-WK2"  # 448 row blocks: no split
    assert rule_label("q4_0", 16, 4096, 4096) == "qmm NB4-WN2-WK2-KS8"
    assert rule_label("q4_0", 32, 28672, 4096) == "qmm NB4-WN4-WK1-XS2-WR1"  # W's ring from 17 rows
    assert rule_label("q4_0", 64, 28672, 4096) == "qmm NB4-WN4-WK1-PF1-XS2"  # W ahead past 32 rows
    assert rule_label("q4_0", 64, 4096, 14336) == "qmm NB2-WN8-WK1-KS4-PF1-XS2"
    assert rule_label("q4_k", 64, 28672, 4096) == "qmm NB4-WN4-WK1-XS2"  # K-quants: neither
    assert rule_label("q8_0", 16, 1024, 3072) == "qmm NB2-WN2-WK4-KS8"  # Qwen3's K: split from 2048
    assert rule_label("q8_0", 16, 4096, 1024) == "qmm NB2-WN2-WK4"


def test_sweep_table_reads_the_rule_and_the_best_against_the_peak():
    table = sweep_table(run_rows()).set_index(["kernel", "M", "N", "K"])
    row = table.loc[("gemv_q4_0", 16, 28672, 4096)]
    # W (28672 x 4096 Q4_0: 66060288 bytes), X and Y over the rule's 39.8 us, against the run's peak
    assert row["rule us"] == 39.8 and 39 < row["rule % peak"] < 41 and row.met == "no"
    assert row.best == "qmm NB4-WN4-WK1-KS4-XS3-WR1" and row["best us"] < row["rule us"]
    staged = table.loc[("gemv_q4_0", 64, 28672, 4096)]
    assert staged.rule == staged.best == "qmm NB4-WN4-WK1-PF1-XS2" and staged.met == ""  # judged at 16 rows only
    qkv = table.loc[("gemv_q4_0", 16, 6144, 4096)]  # the rule (5 parts) not swept in that run: shown, not judged
    assert pd.isna(qkv["rule us"]) and qkv.met == ""


def test_the_command_prints_the_table(capsys):
    assert main([str(CSV), "--sha", "d1c7394"]) == 0
    out = capsys.readouterr().out
    assert "| gemv_q4_0 | 16 | 28672 | 4096 | qmm NB4-WN2-WK2 | 39.8 |" in out
