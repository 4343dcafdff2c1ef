"""The GPU's own kernel timeline on CUDA, read from CUPTI through PyTorch's profiler.

CUPTI records every kernel of the process, whoever launched it, so MLX's kernels (ours and its
built-ins, inside its CUDA graphs) come back with their start and duration on the GPU's clock.
Two users: the benchmarks' `gpu_us` (kernel time per call, next to the round time, which for a
small kernel is bound by MLX's encoding on the host: kernels/gemv/NOTES.md), and
`profile_decode --timeline` (each decode token's kernels and the gaps between them). Where
PyTorch is missing, or the backend is not CUDA, nothing is traced and the callers say so.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from pathlib import Path

Kernel = tuple[float, float, str]  # (start us, duration us, name)


@functools.cache
def available() -> bool:
    """A CUDA backend and PyTorch's profiler importable (LATHE_GPU_TRACE=0 turns it off)."""
    if os.environ.get("LATHE_GPU_TRACE", "1") == "0":
        return False
    from kernels.runtime import backend

    if backend() != "cuda":
        return False
    try:
        import torch.profiler  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def kernel_trace(save_to: Path | None = None):
    """Within the block, the GPU's kernels are recorded; the yielded list is filled at its end
    with (start us, duration us, name) in time order (empty where `available()` is false).
    `save_to` keeps the Chrome trace. The block must synchronize before it ends."""
    kernels: list[Kernel] = []
    if not available():
        yield kernels
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield kernels
    with tempfile.TemporaryDirectory() as tmp:
        path = save_to or Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        kernels.extend(read_trace(Path(path)))


def read_trace(path: Path) -> list[Kernel]:
    """The kernels of a Chrome trace that kernel_trace saved, in time order."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return sorted((e["ts"], e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")


def busy_us(kernels: list[Kernel]) -> float:
    """Time with at least one kernel running (the union of their intervals): kernels that MLX's
    CUDA graphs run side by side (calls with no data between them) are not counted twice."""
    total, end = 0.0, -float("inf")
    for start, duration, _ in sorted(kernels):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
