"""The CLI on the CPU: it says plainly that no GPU backend is present and runs what can run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels.runtime import has_gpu

ROOT = Path(__file__).resolve().parent.parent
cpu_only = pytest.mark.skipif(has_gpu(), reason="tests the CPU-only behaviour")


def lathe(*args: str) -> subprocess.CompletedProcess:
    import os
    import tempfile

    # Preset models are written into LATHE_CACHE: keep them out of the home directory.
    env = dict(os.environ, LATHE_CACHE=os.path.join(tempfile.gettempdir(), "lathe-test-cache"))
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


@cpu_only
@pytest.mark.parametrize("args", [("check",), ("check", "rope"), ("bench", "rope", "--no-write"), ()])
def test_commands_without_gpu_run_the_references(args):
    run = lathe(*args)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "NoGpuBackend" in run.stdout
    assert "reference.rope" in run.stdout and "0 failed" in run.stdout


@cpu_only
def test_peak_without_gpu():
    run = lathe("peak", "--no-write")
    assert run.returncode == 0 and "NoGpuBackend" in run.stdout


def test_decode_of_the_default_model():
    run = lathe("decode", "--gen", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tiny-llama" in run.stdout and "pp16+tg4" in run.stdout


def test_unknown_family_is_an_error():
    run = lathe("check", "nosuch")
    assert run.returncode != 0 and "unknown family" in run.stderr


def test_help_lists_the_commands():
    run = lathe("--help")
    assert run.returncode == 0
    for word in ("check", "bench", "peak"):
        assert word in run.stdout
