"""harness.profile_decode: the ncu CSV is cut into steps at the marker launches (CPU)."""

from __future__ import annotations

import pytest

from harness import profile_decode

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def _row(i, name, unit, value):
    return (f'"{i}","1","python","h","{name}","1","7","(1,1,1)","(1,1,1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"\n')


def test_summarize_sums_the_last_complete_step(tmp_path, capsys):
    rows = [_row(0, "gemv(half*)", "usecond", "99"),  # before the first marker: not counted
            _row(1, "scan_kernel(float*)", "usecond", "2"),
            _row(2, "gemv(half*)", "usecond", "10.5"), _row(3, "gemv(half*)", "nsecond", "1,500"),
            _row(4, "scan_kernel(float*)", "usecond", "2"),
            _row(5, "rope(half*)", "us", "2.5"), _row(6, "rope(half*)", "ns", "500"),  # newer ncu
            _row(7, "scan_kernel(float*)", "usecond", "2")]
    path = tmp_path / "ncu.csv"
    path.write_text("==PROF== Connected to process\n" + HEAD + "".join(rows))
    profile_decode.summarize(path)
    out = capsys.readouterr().out
    assert "2 kernels, 0.003 ms" in out and "rope" in out and "gemv" not in out
    path.write_text(HEAD + "".join(rows[:4]))  # one marker: no complete step
    with pytest.raises(SystemExit, match="fewer than two"):
        profile_decode.summarize(path)
