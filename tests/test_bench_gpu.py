"""The RoPE benchmarks as pytest-benchmark tests: each round is the harness's K calls inside one
evaluation over rotated inputs (pedantic mode), so pytest-benchmark's compare, histogram and JSON
output work on our numbers. Time per call = round time / extra_info['calls'].

    pytest -m bench --benchmark-only [--benchmark-json out.json]
"""

from __future__ import annotations

import pytest

from harness.suites.rope_bench import bench_cases
from harness.timing import Rounds, l2_bytes

pytestmark = pytest.mark.bench

# Decode of every path and the middle prefill size: a short run; `lathe bench` does the rest.
CASES = [c for c in bench_cases(quick=True) if c.shape["seq"] in (1, 2048)]


@pytest.mark.parametrize("case", CASES, ids=[c.label.replace(" ", "-") for c in CASES])
def test_rope(benchmark, case):
    from kernels.runtime import device_name

    rounds = Rounds(case.make_set, case.step, case.set_bytes, l2=l2_bytes(device_name()))
    benchmark.extra_info.update(calls=rounds.calls, bytes_per_call=case.bytes, sets=len(rounds.sets))
    benchmark.pedantic(rounds.run, rounds=7, iterations=1, warmup_rounds=1)
