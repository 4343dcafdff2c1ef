"""The timing method of DESIGN.md.

One eval + synchronize round trip costs about 70 us on MLX's CUDA backend, far more than a
decode kernel, so we never time one launch. A *round* is K calls of the workload inside one
``mx.eval``; the calls walk over S input sets whose total size exceeds 4x the L2 cache, at least two, so
that each call reads from device memory, not from cache (with one set a matrix larger than 4x
L2 still followed itself, and the part of it left in L2 flattered launches that end reading
where the next begins: a v3 GEMV grid read 128256 x 4096 Q4_0 "at" 5.3 TB/s, over the HBM's peak). After a warm-up round, R rounds are
timed; a call costs round_time / K, and we report the median over rounds and the spread
(min, max). The first call of a new kernel compiles it (NVRTC on CUDA): that time is reported
apart, as compile_s.

MLX is lazy: the K calls first build a graph on the host (Python wrappers, argument checks),
then ``mx.eval`` runs it. The round time is the evaluation (MLX's encoding and the GPU work);
the graph building is timed apart and reported as host_us per call, because it is a cost of the
Python caller (which the decode loop measures end to end), not of the kernel.

The GPU's own time (gpu_us, where PyTorch's CUPTI tracer is present) comes from one more pass
whose calls run one by one, each evaluated before the next: a call's own GPU time, as a decode
token's launches get it, each after the one before. A CUPTI trace, once made, slows every
later launch's host work in the process, so `lathe bench` takes every case's wall time first and
the traced passes after all of them (harness.bench.run_cases), and `lathe decode` makes none. The
timed rounds' calls on different sets have no data between them, and MLX's CUDA graph runs them
side by side; their wall time (`us`) is what a stream of independent calls costs.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from harness.tools import gpu_trace

State = dict[str, Any]

# L2 sizes by device name, where MLX does not report one (bytes).
_L2_BY_NAME = {"h100": 50 << 20, "h200": 60 << 20, "a100": 40 << 20}
_DEFAULT_L2 = 128 << 20  # generous: an unknown GPU is assumed to have a large cache


def l2_bytes(device_name: str) -> int:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("l2_cache_size", "l2_size"):
        if int(info.get(key, 0) or 0) > 0:
            return int(info[key])
    name = device_name.lower()
    return next((size for tag, size in _L2_BY_NAME.items() if tag in name), _DEFAULT_L2)


@dataclass
class Timing:
    us: float  # median time per call, microseconds
    us_min: float
    us_max: float
    launches: int  # K, calls per timed round
    repeats: int  # R, timed rounds
    sets: int  # S, rotated input sets
    compile_s: float  # first call, compilation included
    host_us: float  # median time to build one call's graph on the host (not in `us`)
    gpu_us: float = math.nan  # GPU busy time per call (kernels running), one traced pass of
    # calls one by one (Rounds.run_one_by_one: each call alone on the GPU)
    # each kernel's summed duration per call in that pass, longest first: "name=us;name=us"
    # (which launch of a two-launch path costs what: the split attention and its combine); a
    # call's own launches may still overlap each other, and their sum then pass gpu_us
    gpu_kernels: str = ""


def _arrays(state: State) -> list[mx.array]:
    return [v for v in state.values() if isinstance(v, mx.array)]


def _round(
    sets: list[State], step: Callable[[State], list[mx.array]], calls: int
) -> tuple[float, float]:
    """(seconds to evaluate K calls, seconds to build their graph)."""
    outs: list[mx.array] = []
    start = time.perf_counter()
    for k in range(calls):
        outs.extend(step(sets[k % len(sets)]))
    built = time.perf_counter()
    # States may hold lazy arrays (a cache updated by the call): evaluate them with the outputs.
    mx.eval(outs, [_arrays(s) for s in sets])
    mx.synchronize()
    return time.perf_counter() - built, built - start


class Rounds:
    """Input sets built and the call count K calibrated; `run()` times one round of K calls.

    `make_set` builds one input set of about `set_bytes` bytes; `step` runs one call on a set and
    returns what it computes; it may update the set (a cache write stores the updated cache back),
    so later calls build on earlier ones.
    """

    def __init__(
        self,
        make_set: Callable[[], State],
        step: Callable[[State], list[mx.array]],
        set_bytes: int,
        *,
        l2: int,
        min_round_s: float = 0.01,
        max_calls: int = 4000,
        max_sets: int = 64,
    ) -> None:
        self.step = step
        n_sets = max(2, min(max_sets, math.ceil(4 * l2 / max(set_bytes, 1))))
        self.sets = [make_set() for _ in range(n_sets)]
        mx.eval([_arrays(s) for s in self.sets])
        mx.synchronize()

        start = time.perf_counter()
        mx.eval(step(self.sets[0]), _arrays(self.sets[0]))
        mx.synchronize()
        self.compile_s = time.perf_counter() - start

        # Calibrate K so that a round lasts at least min_round_s: the fixed cost of one eval
        # (about 70 us on CUDA) is then a few percent of it. The first pass over the sets is
        # not used: one slow first pass (first-use costs) had left a 4096x14336 GEMV at
        # K = 14, where a round's fixed costs doubled the wall time per call
        # (gemv.csv at b64513c, kernels/gemv/NOTES.md).
        _round(self.sets, step, n_sets)
        per_call = _round(self.sets, step, n_sets)[0] / n_sets
        calls = min(max_calls, max(n_sets, math.ceil(min_round_s / max(per_call, 1e-7))))
        self.calls = math.ceil(calls / n_sets) * n_sets

    def run(self) -> float:
        """Seconds to evaluate one round of K calls (graph building excluded)."""
        seconds, self.last_build_s = _round(self.sets, self.step, self.calls)
        return seconds

    def run_one_by_one(self) -> int:
        """Calls each evaluated before the next is built, so that no two calls' kernels are on
        the GPU at once, as in a decode token, where each launch waits for the one before. (In
        `run` MLX's CUDA graph runs calls on different sets side by side: a launch of a few
        threadgroups then overlaps the next calls' and its busy time per call reads low. qmm at
        16 rows on 4096 x 14336 with 32 threadgroups: 19 us a call in a round, 148 us a launch
        in a prompt's timeline; harness/NOTES.md.) An eval costs the host about 70 us, so not K
        calls: every set once, and at least 64 calls where K has them. Returns how many."""
        calls = max(len(self.sets), min(self.calls, 64))
        for k in range(calls):
            s = self.sets[k % len(self.sets)]
            mx.eval(self.step(s), _arrays(s))
        mx.synchronize()
        return calls


def traced_gpu_us(rounds: Rounds) -> tuple[float, str]:
    """(gpu_us, kernel split) of one more pass over `rounds`' sets, its kernels traced (CUPTI): their
    time, not the host's, a call at a time (each call's own GPU time, not a share of calls run side
    by side); (NaN, "") where no tracer is present."""
    if not gpu_trace.available():
        return math.nan, ""
    with gpu_trace.kernel_trace() as kernels:
        alone = rounds.run_one_by_one()
    return gpu_trace.busy_us(kernels) / alone, kernel_split(kernels, alone)


def time_calls(
    make_set: Callable[[], State],
    step: Callable[[State], list[mx.array]],
    set_bytes: int,
    *,
    l2: int,
    repeats: int = 7,
    min_round_s: float = 0.01,
    max_calls: int = 4000,
    max_sets: int = 64,
    gpu_time: bool = True,
) -> Timing:
    """Time `step` as described in the module docstring (see `Rounds` for the arguments).
    `gpu_time=False` leaves out the traced pass (gpu_us NaN): a CUPTI trace, once made, slows every
    later launch's host work in the process (a Qwen3-0.6B 16-token prompt 2.89 -> 3.33-3.50 ms on
    an H200; harness/NOTES.md), which a process that goes on to time host-bound work must not pay."""
    rounds = Rounds(make_set, step, set_bytes, l2=l2, min_round_s=min_round_s,
                    max_calls=max_calls, max_sets=max_sets)
    rounds.run()  # warm-up at the timed size
    samples, builds = [], []
    for _ in range(repeats):
        samples.append(rounds.run() / rounds.calls * 1e6)
        builds.append(rounds.last_build_s / rounds.calls * 1e6)
    gpu_us, by_kernel = traced_gpu_us(rounds) if gpu_time else (math.nan, "")
    return Timing(
        us=statistics.median(samples),
        us_min=min(samples),
        us_max=max(samples),
        launches=rounds.calls,
        repeats=repeats,
        sets=len(rounds.sets),
        compile_s=rounds.compile_s,
        host_us=statistics.median(builds),
        gpu_us=gpu_us,
        gpu_kernels=by_kernel,
    )


def kernel_split(kernels: list, calls: int) -> str:
    """Each kernel name's summed duration per call, longest first, as "name=us;name=us" (MLX's
    custom_kernel_ prefix and lathe_ dropped; the template constants kept)."""
    total: dict[str, float] = {}
    for _, duration, name in kernels:
        short = name.split("(")[0].removeprefix("void ").split("::")[-1]
        short = short.removeprefix("custom_kernel_").removeprefix("lathe_")
        total[short] = total.get(short, 0.0) + duration
    return ";".join(f"{k}={v / calls:.3f}" for k, v in sorted(total.items(), key=lambda kv: -kv[1]))
