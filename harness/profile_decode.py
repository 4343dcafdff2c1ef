"""Where a decode token's time goes: the GPU's kernel time against the wall-clock time per token.

    python -m harness.profile_decode llama3-8b --qtype q4_0 --variant fused --mode compiled
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file ncu.csv \\
        python -m harness.profile_decode llama3-8b --qtype q4_0 --variant fused --mode compiled --marked
    python -m harness.profile_decode --summarize ncu.csv

The first form times `--tokens` decode steps after a 16-token prompt (wall ms per token). The
second runs `--steps` steps for Nsight Compute, each between two marker launches (a tiny
cumulative sum, whose kernel is the only scan of the run), so that the third form can cut the
profile into steps and sum each kernel's GPU time over the last complete one. Kernel time far
below the wall time per token means the token waits on the host (graph building, encoding,
launch gaps), not on the GPU.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

MARKER = "scan"  # the marker launch's kernel name contains it; nothing in a decode step does
# ncu writes either spelling, depending on its version
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
         "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def _marker() -> None:
    import mlx.core as mx

    mx.eval(mx.cumsum(mx.arange(7, dtype=mx.float32)))


def run(preset: str, qtype: str, variant: str, mode: str, tokens: int, marked: bool, steps: int) -> None:
    import mlx.core as mx

    from harness.decode import make_decoder, model_file
    from harness.models import load_gguf

    model = load_gguf(model_file(preset, qtype))
    c = model.config
    n = steps if marked else tokens
    decoder = make_decoder(model, 16 + n + 8, variant)
    prompt = np.random.default_rng(0).integers(0, c.vocab, 16)
    token = mx.argmax(decoder.forward(prompt)[-1]).reshape(1).astype(mx.int32)
    mx.eval(token)
    fn = decoder.compiled_step() if mode == "compiled" else None

    def step(token):
        if fn is None:
            logits = decoder.forward(token)
        else:
            logits, *caches = fn(token, mx.array([decoder.pos], dtype=mx.int32), *decoder.k, *decoder.v)
            decoder.k, decoder.v = caches[: c.n_layers], caches[c.n_layers:]
            decoder.pos += 1
        nxt = mx.argmax(logits[-1]).reshape(1).astype(mx.int32)
        mx.eval(nxt)
        return nxt

    for _ in range(4):  # warm-up: compilation and first-use costs
        token = step(token)
    times = []
    for _ in range(n):
        if marked:
            _marker()
        start = time.perf_counter()
        token = step(token)
        times.append(time.perf_counter() - start)
    if marked:
        _marker()
    print(f"{preset} {qtype} {variant} {mode}: {1e3 * float(np.median(times)):.3f} ms per token "
          f"(median of {n}{', under the profiler' if marked else ''})")


def summarize(path: Path) -> None:
    """Kernel time of the last complete marked step of an ncu CSV, by kernel name."""
    launches = []  # (ID, kernel name, us) in launch order
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # skip ncu's own log lines
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", ""))
            launches.append((int(row["ID"]), row["Kernel Name"], value * UNITS[row["Metric Unit"]]))
    launches.sort()
    marks = [i for i, (_, name, _) in enumerate(launches) if MARKER in name]
    if len(marks) < 2:
        raise SystemExit(f"{path}: fewer than two marker launches; run with --marked under ncu")
    step = launches[marks[-2] + 1: marks[-1]]
    by_name: dict[str, list[float]] = defaultdict(list)
    for _, name, us in step:
        by_name[name.split("(")[0][:70]].append(us)
    total = sum(us for _, _, us in step)
    print(f"{len(step)} kernels, {total / 1e3:.3f} ms of GPU time in one step")
    print(f"{'kernel':70s} {'launches':>8s} {'us':>10s} {'share':>6s}")
    for name, us in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:70s} {len(us):8d} {sum(us):10.1f} {100 * sum(us) / total:5.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.profile_decode")
    parser.add_argument("model", nargs="?", default="tiny-llama")
    parser.add_argument("--qtype", default="q4_0")
    parser.add_argument("--variant", default="fused")
    parser.add_argument("--mode", default="compiled", choices=("step", "compiled"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--marked", action="store_true", help="marker launches around each step (for ncu)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--summarize", type=Path, help="an ncu CSV of a --marked run")
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args.model, args.qtype, args.variant, args.mode, args.tokens, args.marked, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
