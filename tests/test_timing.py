"""The timing harness's logic, on whatever device MLX has (the CPU in CI)."""

from __future__ import annotations

import mlx.core as mx

from harness.timing import Rounds, l2_bytes, time_calls


def test_sets_cover_four_times_l2_and_calls_are_whole_rotations():
    made = []

    def make():
        made.append(1)
        return {"a": mx.random.normal((1 << 12,))}

    t = time_calls(make, lambda s: [s["a"] * 2], set_bytes=1 << 14, l2=1 << 16, repeats=3)
    assert t.sets == 16 == len(made)  # ceil(4 * 64 KiB / 16 KiB)
    assert t.launches % t.sets == 0 and t.launches >= t.sets
    assert 0 < t.us_min <= t.us <= t.us_max
    assert t.compile_s > 0


def test_a_set_larger_than_the_cache_still_alternates_with_a_second():
    """A call never follows one that read the same data (its leftovers in L2 would flatter it)."""
    t = time_calls(lambda: {"a": mx.random.normal((1 << 12,))}, lambda s: [s["a"] * 2], set_bytes=1 << 20,
                   l2=1 << 16, repeats=1)
    assert t.sets == 2 and t.launches % 2 == 0


def test_step_may_update_its_set_and_the_update_is_evaluated():
    def step(s):
        s["n"] = s["n"] + 1
        return []

    rounds = Rounds(lambda: {"n": mx.array(0)}, step, set_bytes=1 << 30, l2=1, min_round_s=0)
    before = sum(int(s["n"]) for s in rounds.sets)
    rounds.run()
    assert sum(int(s["n"]) for s in rounds.sets) == before + rounds.calls


def test_calibration_is_not_fooled_by_a_slow_first_pass(monkeypatch):
    """A first round that pays first-use costs must not leave K at one rotation of the sets."""
    import harness.timing as timing

    real, passes = timing._round, []

    def slow_first(sets, step, calls):
        seconds, build = real(sets, step, calls)
        passes.append(calls)
        return (seconds + 1.0 if len(passes) == 1 else seconds), build

    monkeypatch.setattr(timing, "_round", slow_first)
    rounds = Rounds(lambda: {"a": mx.random.normal((1 << 10,))}, lambda s: [s["a"] * 2],
                    set_bytes=1 << 14, l2=1 << 14, min_round_s=0.01)
    assert rounds.calls > 4 * len(rounds.sets)  # a 1 s first pass would have left K = 4


def test_l2_from_name_table():
    assert l2_bytes("NVIDIA H200") >= 50 << 20


def test_the_traced_round_evaluates_each_call_before_building_the_next(monkeypatch):
    """gpu_us is a call's own GPU time: in the traced round no two calls are on the GPU at once
    (MLX's CUDA graph runs calls with no data between them side by side)."""
    import contextlib

    import harness.timing as timing

    events, real_eval = [], mx.eval

    def step(s):
        events.append("build")
        return [s["a"] * 2]

    def eval_spy(*arrays):
        events.append("eval")
        return real_eval(*arrays)

    traced_rounds = []

    @contextlib.contextmanager
    def trace():
        traced_rounds.append(len(events))
        yield []

    monkeypatch.setattr(timing.gpu_trace, "available", lambda: True)
    monkeypatch.setattr(timing.gpu_trace, "kernel_trace", trace)
    monkeypatch.setattr(timing.gpu_trace, "busy_us", lambda kernels: 0.0)
    monkeypatch.setattr(timing, "kernel_split", lambda kernels, calls: "")
    monkeypatch.setattr(mx, "eval", eval_spy)
    t = time_calls(lambda: {"a": mx.random.normal((1 << 10,))}, step, set_bytes=1 << 14, l2=1 << 14, repeats=1)
    traced = events[traced_rounds[0]:]
    assert traced == ["build", "eval"] * max(t.sets, min(t.launches, 64))


def test_gpu_time_off_makes_no_trace(monkeypatch):
    """time_calls(gpu_time=False) (lathe decode's peak) never opens a CUPTI trace, which would slow
    every later launch's host work in the process: gpu_us is then NaN."""
    import contextlib
    import math

    from harness import timing

    @contextlib.contextmanager
    def trace():
        raise AssertionError("traced")
        yield []

    monkeypatch.setattr(timing.gpu_trace, "available", lambda: True)
    monkeypatch.setattr(timing.gpu_trace, "kernel_trace", trace)
    t = time_calls(lambda: {"a": mx.random.normal((1 << 10,))}, lambda s: [s["a"] * 2], set_bytes=1 << 14,
                   l2=1 << 14, repeats=1, gpu_time=False)
    assert math.isnan(t.gpu_us) and t.us > 0


def test_a_bench_takes_every_wall_time_before_any_trace(monkeypatch):
    """run_cases (lathe bench) times every case's rounds, then traces each case's GPU time: no wall
    time follows a CUPTI trace, which slows the host's later launches; the rows get the traced
    gpu_us."""
    import contextlib

    from harness import bench, timing

    events = []

    @contextlib.contextmanager
    def trace():
        events.append("trace")
        yield []

    monkeypatch.setattr(timing.gpu_trace, "available", lambda: True)
    monkeypatch.setattr(timing.gpu_trace, "kernel_trace", trace)
    monkeypatch.setattr(timing.gpu_trace, "busy_us", lambda kernels: 5.0)
    monkeypatch.setattr(timing, "kernel_split", lambda kernels, calls: "k=1")
    real = bench.time_calls

    def wall(*args, **kw):
        events.append("wall")
        return real(*args, **kw)

    monkeypatch.setattr(bench, "time_calls", wall)
    cases = [bench.BenchCase("f", "b", "k", f"v{i}", {}, lambda: {"a": mx.random.normal((256,))},
                             lambda s: [s["a"] * 2], 1024, 0, 1 << 20) for i in range(3)]
    rows = bench.run_cases(cases, 100.0, "cpu", "cpu", {}, repeats=1)
    assert events == ["wall"] * 3 + ["trace"] * 3
    assert all(r["gpu_us"] > 0 and r["gpu_kernels"] == "k=1" for r in rows)
