"""harness.tools.ncu_sass on source pages written as ncu writes them: a block per kernel, samples
and executed counts summed by opcode (modifiers and predicates dropped), the most sampled first."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from harness.tools.ncu_sass import EXECUTED, SAMPLES, main, read_sass

HEADER = ["Address", "Source", SAMPLES, "Warp Stall Sampling (Not-issued Samples)", "# Samples", EXECUTED]
KERNELS = {"custom_kernel_lathe_qmm(int)": [("LDG.E.128 R4, desc[UR4][R2.64]", 3, 10),
                                            ("SHF.R.U32.HI R65, RZ, 0x4, R4", 50, 10),
                                            ("@P1 SHF.R.U32.HI R66, RZ, 0x4, R5", 10, 10),
                                            ("HMMA.16816.F32 R8, R12, R16, R8", 7, 20),
                                            ("EXIT", 0, 50)],
           "custom_kernel_lathe_qmm_reduce(int)": [("LDG.E R2, desc[UR4][R2.64]", 4, 1), ("FADD R3, R2, R3", 1, 3)]}


def _write(path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, rows in KERNELS.items():
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (text, samples, executed) in enumerate(rows):
                w.writerow([hex(0x7000 + 16 * i), "      " + text, samples, samples, samples, f"{executed:,}"])


def test_samples_and_executed_by_opcode_per_kernel(tmp_path, capsys):
    _write(tmp_path / "sass.csv")
    qmm, reduce = read_sass(tmp_path / "sass.csv")
    assert qmm.name == "custom_kernel_lathe_qmm(int)" and len(qmm.rows) == 5 and len(reduce.rows) == 2
    ops = {op: (s, e) for op, s, e in qmm.by_opcode()}
    assert ops["SHF"] == pytest.approx((60 / 70, 20 / 100))  # the predicated one counted as SHF
    assert ops["HMMA"] == pytest.approx((7 / 70, 20 / 100)) and ops["EXIT"] == pytest.approx((0, 0.5))
    assert qmm.by_opcode()[0][0] == "SHF" and qmm.top(1) == [("SHF.R.U32.HI R65, RZ, 0x4, R4", 50)]
    assert main([str(tmp_path / "sass.csv"), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("== custom_kernel_lathe_qmm") == 2 and "85.7%" in out


def test_a_file_without_the_samples_is_refused(tmp_path):
    (tmp_path / "details.csv").write_text('"Kernel Name","k"\n"Address","Source"\n"0x1","EXIT"\n')
    with pytest.raises(ValueError, match="SourceCounters"):
        read_sass(tmp_path / "details.csv")


def test_the_committed_qmm_profile_reads():
    """e04a574's profile of qmm at 16 rows (kernels/gemv/NOTES.md's table): the shifts of W's words
    take about half the samples, the half2 decode half the executed instructions."""
    (kernel,) = read_sass(Path(__file__).parents[1] / "results/nvidia-h200/logs/ncu-qmm-m16-sass-e04a574.csv")
    ops = {op: (s, e) for op, s, e in kernel.by_opcode()}
    assert 0.45 < ops["SHF"][0] < 0.55
    assert 0.45 < ops["PRMT"][1] + ops["HADD2"][1] + ops["HMUL2"][1] < 0.55
