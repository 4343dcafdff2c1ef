"""harness.tools.serve_profile on the CPU: decode-only steps timed after the prompts, and the
kernel trace's arithmetic (busy time, its share of the span, launches and the heaviest kernels a
step) on a trace made up here, since CUPTI needs a CUDA GPU."""

from __future__ import annotations

import contextlib

import pytest

from harness.program.models import load_gguf, write_random_gguf
from harness.tools import gpu_trace, serve_profile


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_gguf(write_random_gguf(tmp_path_factory.mktemp("profile") / "tiny.gguf", "tiny-llama", "q8_0", seed=5))


def test_without_a_trace_a_row_has_the_wall_time_only(tiny, monkeypatch):
    monkeypatch.setattr(gpu_trace, "available", lambda: False)
    row = serve_profile.profile_batch(tiny, "reference", batch=3, prompt=6, steps=2)
    assert row["variant"] == "reference" and row["batch"] == 3 and row["steps"] == 2
    assert row["wall_ms"] > 0 and "gpu_busy_ms" not in row


def test_the_trace_is_summed_per_step(tiny, monkeypatch):
    # two steps' kernels: two overlap (MLX's graph runs them side by side), a gap of 40 us
    made_up = [(0.0, 10.0, "lathe_gemv_v3"), (5.0, 10.0, "lathe_paged_attention"), (15.0, 20.0, "lathe_gemv_v3"),
               (75.0, 5.0, "lathe_argmax")]

    @contextlib.contextmanager
    def trace(save_to=None):
        kernels: list = []
        yield kernels
        kernels.extend(made_up)

    monkeypatch.setattr(gpu_trace, "available", lambda: True)
    monkeypatch.setattr(gpu_trace, "kernel_trace", trace)
    row = serve_profile.profile_batch(tiny, "reference", batch=2, prompt=5, steps=2, top=2)
    assert row["gpu_busy_ms"] == pytest.approx(40.0 / 2 / 1e3)  # 0-35 and 75-80 us, over 2 steps
    assert row["busy_pct"] == pytest.approx(100 * 40 / 80, abs=0.1)
    assert row["launches"] == 2.0
    assert row["top"] == "lathe_gemv_v3 15 us, lathe_paged_attention 5 us"


def test_a_profile_refuses_steps_that_are_not_decode_only(tiny):
    sched, forward = serve_profile._admitted(tiny, "reference", batch=1, prompt=4, steps=1, seed=0)
    only = sched.running[0]
    only.max_new = len(only.output) + 1  # ends at the next step: the one after has nothing to run
    with pytest.raises(RuntimeError, match="not decode-only"):
        serve_profile._decode_steps(sched, forward, 2)


def test_the_command_line_runs_on_the_cpu(capsys):
    assert serve_profile.main(["tiny-llama", "--batch", "1,2", "--steps", "2", "--prompt", "4",
                               "--variant", "reference"]) == 0
    out = capsys.readouterr().out
    assert "no GPU trace here" in out and "wall_ms" in out


def test_the_host_split_adds_up_to_the_wall_time(tiny, monkeypatch):
    monkeypatch.setattr(gpu_trace, "available", lambda: False)
    row = serve_profile.profile_batch(tiny, "reference", batch=2, prompt=5, steps=3)
    parts = [row[k] for k in ("scheduler_ms", "build_ms", "encode_ms", "wait_ms")]
    assert all(p >= 0 for p in parts) and row["encode_ms"] > 0
    assert sum(parts) == pytest.approx(row["wall_ms"], abs=0.01)


def test_the_alloc_probe_says_when_there_is_nothing_to_time(capsys):
    """harness.tools.alloc_probe times on the GPU's clock only: without a trace it says so."""
    from harness.tools import alloc_probe, gpu_trace

    if gpu_trace.available():
        pytest.skip("a GPU trace is here: the device run times the probe")
    assert alloc_probe.main([]) == 0
    assert "nothing to time" in capsys.readouterr().out
