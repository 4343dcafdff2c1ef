"""The device's memory peak, measured in the same process as the results it scales.

Two large device copies (bytes read + bytes written over time): our 16-byte-word copy kernel
and MLX's own elementwise path (``a + 1`` on uint32). The peak is the faster of the two; both
are reported so that a reader can see what each reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from harness.timing import Timing, l2_bytes, time_calls
from kernels.bandwidth import copy16
from kernels.runtime import device_name, require_gpu

PEAK_BYTES = 1 << 30  # each copy reads 1 GiB and writes 1 GiB


@dataclass
class Peak:
    gbs: float
    by_workload: dict[str, tuple[Timing, float]]  # name -> (timing, GB/s)


def _workloads():
    return {
        "lathe.copy16": copy16,
        "mlx.add": lambda a: a + mx.array(1, dtype=mx.uint32),
    }


def measure_peak(nbytes: int = PEAK_BYTES, repeats: int = 7, gpu_time: bool = True) -> Peak:
    """`gpu_time=False`: wall time only, no CUPTI trace (harness.timing.time_calls says why)."""
    require_gpu()
    n = nbytes // 4
    l2 = l2_bytes(device_name())
    results = {}
    for name, fn in _workloads().items():
        timing = time_calls(
            lambda: {"a": mx.random.randint(0, 2**31 - 1, (n,), dtype=mx.uint32)},
            lambda s, fn=fn: [fn(s["a"])],
            2 * nbytes,
            l2=l2,
            repeats=repeats,
            min_round_s=0.02,
            max_sets=2,
            gpu_time=gpu_time,
        )
        results[name] = (timing, 2 * nbytes / (timing.us * 1e-6) / 1e9)
    return Peak(gbs=max(g for _, g in results.values()), by_workload=results)
