"""harness.tools.launch_spread on made-up kernel lists and a saved trace (CPU)."""

from __future__ import annotations

import json

import pytest

from harness.tools import launch_spread


def _kernels(durations: list[float]) -> list:
    out, t = [], 0.0
    for d in durations:
        out += [(t, 3.0, "embed"), (t + 4, d, "lathe_token_block_x"), (t + 5 + d, 49.0, "head")]
        t += d + 60
    return out


def test_a_period_of_four_launches_shows_at_lag_four():
    durations = [1400, 1550, 1680, 1540] * 16
    row = launch_spread.spread(_kernels(durations))
    assert row["kernel"] == "lathe_token_block_x" and row["launches"] == 64
    assert row["lag_correlation"][4] == 1.0 and row["lag_correlation"][2] < -0.5
    assert row["p10_50_90_max"][0] == 1400 and row["p10_50_90_max"][-1] == 1680
    assert row["first"][:4] == [1400, 1550, 1680, 1540] and row["others"] == {"embed": 3.0, "head": 49.0}


def test_the_kernel_is_found_by_a_part_of_its_name_or_refused():
    kernels = _kernels([1500.0] * 8)
    assert launch_spread.spread(kernels, "head")["kernel"] == "head"
    assert launch_spread.spread(kernels, "head")["lag_correlation"] == {}  # no spread, no correlation
    with pytest.raises(ValueError, match="no kernel"):
        launch_spread.spread(kernels, "argmax")
    with pytest.raises(ValueError, match="no kernel"):
        launch_spread.spread([])


def test_the_command_reads_a_saved_trace(tmp_path, capsys):
    events = [{"cat": "kernel", "ts": s, "dur": d, "name": n} for s, d, n in _kernels([1400, 1700] * 6)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events + [{"cat": "cuda_runtime", "ts": 0, "dur": 1, "name": "x"}]}))
    assert launch_spread.main([str(path), "--kernel", "token_block", "--first", "4"]) == 0
    out = capsys.readouterr().out
    assert "12 launches" in out and "[1400, 1700, 1400, 1700]" in out and "{1: -1.0, 2: 1.0" in out
