"""The test suite's own options (tests/conftest.py): --shard and --record-launches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def collected(*args: str) -> list[str]:
    run = pytest_run("--collect-only", *args)
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_shards_split_the_suite_without_overlap():
    whole = collected("tests/test_cli.py")
    shards = [collected("tests/test_cli.py", "--shard", f"{i}/3") for i in range(3)]
    assert len(whole) > 10 and all(shards)
    assert sorted(sum(shards, [])) == sorted(whole)
    bad = pytest_run("--collect-only", "tests/test_cli.py", "--shard", "3/3")
    assert bad.returncode != 0 and "below N" in bad.stderr


def test_record_launches_writes_the_gpu_tests_modules(tmp_path):
    """Any machine: the GPU tests run with launches recorded, and the file lists their modules in
    the form `lathe compile --recorded` reads (outcomes on recorded zeros are not judged)."""
    from harness.nvrtc import read_instances

    path = tmp_path / "tests.gz"
    run = pytest_run("--tb=no", "tests/test_kernel_decode.py", "-k", "prompt_options and last-f16-3-fused and not repacked",
                     "--record-launches", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--record-launches:" in run.stdout and "deselected" in run.stdout
    modules = read_instances(path, tmp_path / "sources")
    assert modules and all(m.name.startswith("lathe_") for m in modules)
