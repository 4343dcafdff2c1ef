"""GPU tests are marked `gpu` (benchmarks `bench`) and skipped, with the reason, without a GPU.

`--record-launches F` (any machine) runs the GPU tests with their kernel launches recorded
instead of executed (kernels.runtime.recording: outputs are zeros, so outcomes mean nothing)
and writes the distinct CUDA modules to F, the format of `lathe compile --record`: on the
device, `lathe compile --recorded F` then compiles them in parallel, where the suite would
otherwise compile each one in its own test, one at a time (the decode tests' token blocks once kept
`tests-rest` past its call).

`--shard I/N` keeps every N-th test from the I-th: N processes share the suite (its reference
cases run float64 NumPy on the host, one core a process; `.ci/device tests-shards`).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--record-launches", metavar="FILE", default=None,
                     help="record the GPU tests' launches (not run) into FILE for `lathe compile --recorded`")
    from harness.cli import shard_spec

    parser.addoption("--shard", metavar="I/N", type=shard_spec, default=None,
                     help="only every N-th test from the I-th (N processes share the suite)")


def pytest_collection_modifyitems(config, items):
    from kernels.runtime import backend, has_gpu

    shard = config.getoption("--shard")
    if shard:
        index, count = shard
        config.hook.pytest_deselected(items=[item for n, item in enumerate(items) if n % count != index])
        items[:] = items[index::count]
    if config.getoption("--record-launches"):
        deselected = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if "gpu" in item.keywords]
        config._lathe_modules = {}
        return
    if has_gpu():
        return
    skip = pytest.mark.skip(reason=f"no GPU backend (MLX backend: {backend()}); run on the device")
    for item in items:
        if "gpu" in item.keywords or "bench" in item.keywords:
            item.add_marker(skip)


def _recorded(item):
    """A hook's body with the test's launches recorded (set-up and call: fixtures launch too)."""
    modules = getattr(item.config, "_lathe_modules", None)
    if modules is None:
        yield
        return
    import kernels.runtime as rt

    with rt.recording("cuda", keep_prepared=True) as rec:
        yield
    modules.update((rt.instance(job, cuda=True), None) for job in rec.jobs + rec.prepared)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _recorded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _recorded(item)


def pytest_runtest_teardown(item):
    """Sharded, every test gives its freed device buffers back (harness.check: twelve processes
    that each keep MLX's cache run one GPU out of memory)."""
    if item.config.getoption("--shard") and "gpu" in item.keywords:
        import mlx.core as mx

        mx.clear_cache()


def pytest_sessionfinish(session, exitstatus):
    modules = getattr(session.config, "_lathe_modules", None)
    if modules is None:
        return
    from pathlib import Path

    from harness.nvrtc import write_instances

    path = Path(session.config.getoption("--record-launches"))
    write_instances(path, list(modules))
    print(f"\n--record-launches: {len(modules)} modules into {path} (test outcomes on recorded zeros are "
          f"not checked); `lathe compile --recorded {path}` compiles them on CUDA")
    session.exitstatus = pytest.ExitCode.OK
