"""Where a serve step's time goes: wall time against the GPU's own kernel time, by batch size.

    python -m harness.tools.serve_profile qwen3-0.6b --qtype q8_0 --batch 1,8,64 --variant fused
    python -m harness.tools.serve_profile llama3-8b --qtype q4_0 --batch 8 --steps 32 --timeline trace.json

For each batch size: the batch's requests (all at step 0, `--prompt` tokens each, as
`lathe serve` without --mixed) are admitted and prefilled untimed, then `--steps` decode-only
steps of the batched forward (harness.program.batch_forward) are timed on the host, and then run
again under the GPU's kernel trace (CUPTI, harness.tools.gpu_trace). A row per batch:
- `wall_ms`: a decode step's wall time (the untraced run; pipelined, so host and GPU overlap);
- `gpu_busy_ms`: the time a step has at least one kernel running, and `busy_pct` its share of
  the traced steps' span on the GPU. Far below 100%: the GPU waits for the host (building and
  encoding the step, launch gaps), so fewer launches or less host work a step, not faster
  kernels, is what the step needs;
- `launches`: kernels a step, and the kernels that take most of a step's GPU time;
- the host's split of `wall_ms` (the untraced run): `scheduler_ms` (the scheduler and the pool),
  `build_ms` (the forward's inputs and its compiled call, which builds the step's graph),
  `encode_ms` (mx.async_eval: MLX encoding the step's kernels) and `wait_ms` (reading the
  tokens of the step before). A step whose wait is near zero is the host's.
The tracer slows the host, so the wall time comes from the run without it. Without a CUDA
backend (or PyTorch) there is no trace: the wall times only, and the tool says so.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import mlx.core as mx

from harness.tools import gpu_trace, launch_spread


def _admitted(model, variant: str, batch: int, prompt: int, steps: int, seed: int):
    """A scheduler with `batch` requests admitted and prefilled (and one decode step run), its
    forward, ready for `steps` more decode-only steps."""
    from harness.program.batch_forward import make_batch_forward
    from harness.program.serve import Scheduler
    from harness.serve_bench import Workload

    # gen: the prompt's and the first decode step's tokens, 2 warm-up steps, the untimed and the
    # traced steps, and some to spare: no request ends inside
    work = Workload(batch, prompt, 2 * steps + 8, seed=seed)
    pool = work.pool()
    forward = make_batch_forward(model, variant, pool, work.prompt + work.gen)
    sched = Scheduler(pool, batch)
    for r in work.requests(model.config.vocab):
        sched.submit(r)
    sched.step(forward)  # the prompts
    sched.step(forward)  # the first decode step, which waits for the prompts' tokens
    return sched, forward


class _Timed:
    """The forward as the scheduler calls it, its seconds summed ('forward')."""

    def __init__(self, forward, timings: dict):
        self.forward, self.timings = forward, timings

    def __call__(self, work):
        began = time.perf_counter()
        try:
            return self.forward(work)
        finally:
            self.timings["forward"] = self.timings.get("forward", 0.0) + time.perf_counter() - began


def _decode_steps(sched, forward, steps: int) -> float:
    """Seconds for `steps` decode-only steps, the last one's tokens read."""
    mx.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        work = sched.step(forward)
        if any(w.prefill for w in work) or not work:
            raise RuntimeError("a profiled step was not decode-only: a request ended or was admitted")
    int(sched.running[0].output[-1])  # pipelined: the last step's tokens, read
    mx.synchronize()
    return time.perf_counter() - began


def profile_batch(model, variant: str, batch: int, prompt: int, steps: int, seed: int = 0,
                  top: int = 5, timeline: str | None = None, trace: bool = True) -> dict:
    """One batch size's row (module docstring): the untraced steps' wall time, then (`trace`)
    the same number of steps under the kernel trace."""
    sched, forward = _admitted(model, variant, batch, prompt, steps, seed)
    _decode_steps(sched, forward, 2)  # compiled steps traced and compiled here, not below
    # the line harness.tools.host_profile waits for before it samples the timed steps
    print(f"timing {steps} decode steps of {batch} sequences", flush=True)
    timings: dict[str, float] = {}
    forward.timings = timings
    wall = _decode_steps(sched, _Timed(forward, timings), steps)
    forward.timings = None
    ms = lambda seconds: round(seconds / steps * 1e3, 3)  # noqa: E731 - a step's share, in ms
    # the host's split of a step: the scheduler's own work, the forward building the step (its
    # inputs, the compiled call), MLX encoding it (mx.async_eval), waiting for tokens
    forward_s, encode_s, wait_s = (timings.get(k, 0.0) for k in ("forward", "encode", "wait"))
    row = dict(variant=forward.variant, batch=batch, steps=steps, wall_ms=ms(wall), scheduler_ms=ms(wall - forward_s),
               build_ms=ms(forward_s - encode_s - wait_s), encode_ms=ms(encode_s), wait_ms=ms(wait_s))
    if not trace or not gpu_trace.available():
        return row
    from pathlib import Path

    with gpu_trace.kernel_trace(Path(timeline) if timeline else None) as kernels:
        _decode_steps(sched, forward, steps)
    if not kernels:
        return dict(row, error="the trace recorded no kernel")
    span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    busy = gpu_trace.busy_us(kernels)
    by_name: dict[str, float] = defaultdict(float)
    for _, duration, name in kernels:
        by_name[name] += duration
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    # the heaviest kernel launch by launch: a spread far past the context's growth over the steps
    # says some launches wait on something else (a managed page's fault, the clock)
    spread = "/".join(str(us) for us in launch_spread.spread(kernels, heaviest[0][0])["p10_50_90_max"])
    return dict(row, gpu_busy_ms=round(busy / steps / 1e3, 3), busy_pct=round(100 * busy / span, 1),
                launches=round(len(kernels) / steps, 1), heaviest_p10_50_90_max=spread,
                top=", ".join(f"{name.removeprefix('mlx::core::cu::custom_kernel_')[:48]} {us / steps:.0f} us"
                            for name, us in heaviest))


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    from harness.program.decode import model_file
    from harness.program.models import load_gguf
    from harness.results import backend_line
    from kernels import options

    p = argparse.ArgumentParser(prog="python -m harness.tools.serve_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a .gguf file or a preset")
    p.add_argument("--qtype", default="q8_0")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed (and as many traced)")
    p.add_argument("--variant", default="fused")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=5, help="kernels named a row, those of most GPU time first")
    p.add_argument("--timeline", help="keep the last batch's Chrome trace here")
    p.add_argument("--set", default="", metavar="NAME=VALUE[,...]", help="experiment options (`lathe options`)")
    p.add_argument("--no-trace", action="store_true", help="the untraced steps only (host_profile --serve)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.prompt < 1 or a.top < 1:
        p.error("--steps, --prompt and --top must be at least 1")
    print(backend_line())
    if not gpu_trace.available():
        print("no GPU trace here (it needs a CUDA backend and PyTorch's profiler): wall times only")
    model = load_gguf(model_file(a.model, a.qtype, a.seed))
    with options.use(**options.parse(a.set)):
        rows = [profile_batch(model, a.variant, int(b), a.prompt, a.steps, a.seed, a.top, a.timeline,
                              trace=not a.no_trace)
                for b in str(a.batch).split(",")]
    with pd.option_context("display.width", 250, "display.max_colwidth", 200):
        print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
