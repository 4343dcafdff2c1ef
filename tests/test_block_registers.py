"""harness.tools.block_registers off the device: the token block's modules recorded at a context
length under an option set (no GPU), and read by NVRTC here where it is found."""

from __future__ import annotations

import pytest

from harness.tools import block_registers
from tests.test_nvrtc_compile import _available as _nvrtc_missing


def test_the_plain_and_stamped_token_modules_are_recorded_at_each_length():
    """Unsplit at 200 rows, split at 600 (from 512); the stamped module apart from the plain one;
    an option set reaches the recorded launches (block_min_groups: the launch bounds)."""
    short = block_registers.token_block_launches("qwen3-0.6b", "q8_0", 200)
    assert sorted(kind for kind, _ in short) == ["plain", "stamped"]
    assert not any("_split" in job.spec.name for _, job in short)
    split = block_registers.token_block_launches("qwen3-0.6b", "q8_0", 600, {"block_min_groups": 4})
    assert sorted(kind for kind, _ in split) == ["plain", "stamped"]
    for kind, job in split:
        assert "_split" in job.spec.name and ("_timeline" in job.spec.name) == (kind == "stamped")
        assert job.spec.launch_bounds == (job.threadgroup[0], 4)
    with pytest.raises(SystemExit, match="unknown preset"):
        block_registers.token_block_launches("no-such-model", "q8_0", 200)
    with pytest.raises(SystemExit, match=r"a context of 64\.\.4096 rows \(llama2-7b's\), got 4300"):
        block_registers.token_block_launches("llama2-7b", "q4_0", 4300)


def test_the_batch_forms_modules_are_recorded_for_serves_step():
    """--batch N: serve's megafused step of N sequences, token_block's batch form over a paged pool,
    unsplit at 200 rows and split at 1100 (the plain module and the stamped one)."""
    for context, split in ((200, False), (1100, True)):
        found = block_registers.token_block_launches("qwen3-0.6b", "q8_0", context, None, batch=8)
        assert sorted(kind for kind, _ in found) == ["plain", "stamped"]
        for _, job in found:
            assert "_paged" in job.spec.name and job.constants["M"] == 8
            assert ("_split" in job.spec.name) is split


@pytest.mark.skipif(bool(_nvrtc_missing()), reason=_nvrtc_missing() or "available")
def test_nvrtc_here_reads_registers_under_the_bound(capsys):
    """Off the device, ptxas' counts: the bound of 4 threadgroups of 128 threads holds a module to
    128 registers and 4 an SM."""
    assert block_registers.main(["qwen3-0.6b", "--context", "600", "--ab", "block_min_groups=4"]) == 0
    out = capsys.readouterr().out
    assert "NVRTC here" in out and "128x4" in out
    (row,) = [r for r in block_registers.rows("qwen3-0.6b", "q8_0", [600], ["block_min_groups=4"])
              if r["module"] == "plain"]
    assert row["registers"] <= 128 and row["per_sm"] >= 4 and row["split"] == 1


def test_without_nvrtc_or_a_device_it_says_so(monkeypatch, capsys):
    def missing(jobs):
        raise FileNotFoundError("no libnvrtc")

    monkeypatch.setattr("harness.nvrtc.resource_table", missing)
    assert block_registers.main(["qwen3-0.6b", "--context", "200"]) == 2
    assert "neither a CUDA device nor NVRTC here (no libnvrtc)" in capsys.readouterr().out
