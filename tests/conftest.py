"""GPU tests are marked `gpu` (benchmarks `bench`) and skipped, with the reason, without a GPU."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    from kernels.runtime import backend, has_gpu

    if has_gpu():
        return
    skip = pytest.mark.skip(reason=f"no GPU backend (MLX backend: {backend()}); run on the device")
    for item in items:
        if "gpu" in item.keywords or "bench" in item.keywords:
            item.add_marker(skip)
