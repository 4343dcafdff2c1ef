"""The main job (`lathe` with no command, harness.main_job) on any machine: its checks in worker
processes give what one process gives, a failing case is named in the summary, and the bench
summary reads the best % of the peak and the unfused/fused ratio from a family's rows."""

import numpy as np

from harness import main_job
from harness.check import CheckCase, Comparison


def test_the_checks_in_two_processes_count_what_one_process_counts():
    one = main_job.run_checks(gpu=False, jobs=1, seed=3)
    two = main_job.run_checks(gpu=False, jobs=2, seed=3)
    assert {n: (c.passed, c.failures) for n, c in one.items()} == {n: (c.passed, c.failures) for n, c in two.items()}
    assert sum(c.passed for c in one.values()) > 0 and not any(c.failures for c in one.values())
    # the rows of each family in its cases' order, whichever process ran them
    assert [[r["shape"] for r in c.rows] for c in one.values()] == [[r["shape"] for r in c.rows] for c in two.values()]


def test_a_selection_and_a_shard_take_the_cases_check_takes():
    every = main_job.run_checks(gpu=False, jobs=1, families=["rope"])["rope"].rows
    picked = main_job.run_checks(gpu=False, jobs=1, families=["rope"], match="head_dim=64")["rope"].rows
    assert picked and all("head_dim=64" in r["shape"] for r in picked) and len(picked) < len(every)
    halves = [main_job.run_checks(gpu=False, jobs=1, families=["rope"], shard=(i, 2))["rope"].rows for i in (0, 1)]
    assert sorted(r["kernel"] + r["shape"] for h in halves for r in h) == sorted(r["kernel"] + r["shape"] for r in every)


def test_a_failing_case_is_named_in_the_summary(monkeypatch):
    def wrong(rng):
        return [Comparison("y", 0.5, 1e-3)]

    def broken(rng):
        raise ValueError("no such shape")

    cases = [CheckCase("rope", "rope_demo", "fused", dict(N=7), wrong, needs_gpu=False),
             CheckCase("rope", "rope_demo", "unfused", dict(N=9), broken, needs_gpu=False)]
    monkeypatch.setitem(main_job._CASES, ("rope", False, False), cases)
    report = main_job.Report(checks=main_job.run_checks(gpu=False, jobs=1, families=["rope"]))
    assert report.checks["rope"].passed == 0 and len(report.checks["rope"].failures) == 2
    assert [r["result"].startswith("FAIL") for r in report.checks["rope"].rows] == [True, True]
    text = main_job.summary(report, gpu=False)
    assert "0 passed, 2 failed" in text
    assert "FAIL rope: rope_demo [fused] N=7" in text and "ValueError: no such shape" in text
    assert "No GPU backend here" in text


def test_the_bench_summary_takes_the_best_and_the_median_unfused_over_fused():
    rows = [dict(benchmark="gemv-fused", kernel="rmsnorm_gemv", variant=v, M=1, N=n, K=4096, us=us, pct_peak=p)
            for v, n, us, p in (("fused", 4096, 10.0, 70.0), ("unfused", 4096, 15.0, 40.0),
                                ("fused-v3", 14336, 20.0, 88.5), ("unfused", 14336, 50.0, 30.0),
                                ("fused", 1024, 3.0, 20.0))]  # no unfused row at 1024: no ratio there
    best, ratio = main_job.bench_summary(rows)
    assert best == 88.5
    assert np.isclose(ratio, np.median([15.0 / 10.0, 50.0 / 20.0]))
    assert main_job.bench_summary([]) == (None, None)


def test_a_dead_worker_fails_its_cases_by_name():
    """A GPU fault ends a worker (and the pool): each case it leaves undone is a failed row with
    the reason, not a traceback that loses the rows already done."""
    import concurrent.futures
    from concurrent.futures.process import BrokenProcessPool

    done = concurrent.futures.Future()
    done.set_exception(BrokenProcessPool("a child process terminated abruptly"))
    row = main_job._result(done, "rope", 0, gpu=False, quick=False)
    case = main_job.family_cases("rope", False)[0]
    assert not row["passed"] and row["kernel"] == case.kernel
    assert row["result"] == "FAIL BrokenProcessPool: a child process terminated abruptly"


def test_the_main_job_checks_quick_unless_full(monkeypatch):
    """A first run checks every kernel path once (the whole check ran past 10 minutes on a cold
    H100); `--full` takes every case."""
    seen = []

    def checks(gpu, jobs, seed=None, families=None, quick=False, **_):
        seen.append(quick)
        return {"rope": main_job.FamilyCheck()}

    monkeypatch.setattr(main_job, "run_checks", checks)
    monkeypatch.setattr(main_job, "run_decode", lambda gpu, report, decode: 0)
    for full in (False, True):
        assert main_job.run(1, full, bench=None, decode=None) == 0
    assert seen == [True, False]


def test_a_case_size_is_its_shapes_product_and_rows_keep_their_order(monkeypatch):
    """A pool takes the largest cases first (case_size); the rows come back in the cases' order."""
    order = []
    sizes = [3, 500, 7, 40]
    cases = [CheckCase("rope", "rope_demo", "plain", dict(N=n, D=2), lambda rng, n=n: order.append(n) or [],
                       needs_gpu=False) for n in sizes]
    monkeypatch.setitem(main_job._CASES, ("rope", False, False), cases)
    assert [main_job.case_size(c) for c in cases] == [6, 1000, 14, 80]
    rows = main_job.run_checks(gpu=False, jobs=1, families=["rope"])["rope"].rows
    assert [r["shape"] for r in rows] == [f"N={n} D=2" for n in sizes] and order == sizes  # one process: as listed


def _blas_threads_seen(_):
    import os

    return os.environ.get("OPENBLAS_NUM_THREADS"), os.environ.get("OMP_NUM_THREADS")


def test_workers_share_the_hosts_cores_among_their_blas_threads(monkeypatch):
    """Each worker's BLAS gets cores / jobs threads (not every core each); what the user set is
    kept; the parent's environment is as it was afterwards."""
    import concurrent.futures
    import multiprocessing
    import os

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    with main_job.host_cores_shared(2):
        future = pool.submit(_blas_threads_seen, 0)
    assert future.result(timeout=120) == ("4", "3")
    pool.shutdown()
    assert "OPENBLAS_NUM_THREADS" not in os.environ and os.environ["OMP_NUM_THREADS"] == "3"
    with main_job.host_cores_shared(16):  # more workers than cores: one thread each
        assert os.environ["OPENBLAS_NUM_THREADS"] == "1"


def test_rows_carry_seconds_and_the_next_run_takes_the_longest_first(monkeypatch, tmp_path):
    monkeypatch.setenv("LATHE_CACHE", str(tmp_path))
    rows = main_job.run_checks(gpu=False, jobs=1, families=["rope"])["rope"].rows
    assert rows and all(isinstance(r["seconds"], float) and r["seconds"] >= 0 for r in rows)
    quick, slow, new = (CheckCase("rope", "k", v, dict(N=n), None) for v, n in (("a", 9), ("b", 2), ("c", 1)))
    main_job._keep_seconds({main_job._seconds_key(quick, True): 0.5, main_job._seconds_key(slow, True): 7.0})
    last = main_job._last_seconds()
    assert last == {"rope gpu k[a](N=9)": 0.5, "rope gpu k[b](N=2)": 7.0}
    # never timed (a new case) first, then by last time, longest first; the size no longer decides
    order = sorted([quick, slow, new], key=lambda c: main_job._longest_first(c, True, last))
    assert [c.variant for c in order] == ["c", "b", "a"]
    main_job._seconds_file().write_text("not json")  # unreadable: the sizes order the run
    assert main_job._last_seconds() == {}
