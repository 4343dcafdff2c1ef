"""Where a decode token's time goes: the GPU's kernel time against the wall-clock time per token.

    python -m harness.tools.profile_decode llama3-8b --qtype q4_0 --variant fused --mode compiled
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file ncu.csv \\
        python -m harness.tools.profile_decode llama3-8b --qtype q4_0 --variant fused --mode compiled --marked
    python -m harness.tools.profile_decode --summarize ncu.csv

    python -m harness.tools.profile_decode llama3-8b --qtype q4_0 --variant fused --mode compiled-pipelined
    python -m harness.tools.profile_decode llama3-8b --mode compiled-pipelined --timeline trace.json
    python -m harness.tools.profile_decode --read-timeline trace.json
    python -m harness.tools.profile_decode llama2-7b --seams-ab 5
    python -m harness.tools.profile_decode qwen3-0.6b --qtype q8_0 --prompt 512 --depth 4096 --timeline trace.json

The first form times `--tokens` decode steps after a 16-token prompt (wall ms per token). The
second runs `--steps` steps for Nsight Compute, each between two marker launches (a tiny
cumulative sum, whose kernel is the only scan of the run), so that the third form can cut the
profile into steps and sum each kernel's GPU time over the last complete one. Kernel time far
below the wall time per token means the token waits on the host (graph building, encoding,
launch gaps), not on the GPU. The last form (mlx-lm's loop: step n+1 queued before token n is
read) splits each token's wall time on the host: `call`, the compiled step building its graph;
`encode`, mx.async_eval, where MLX encodes every op and hands it to the GPU (on CUDA, in the
calling thread); `wait`, reading the token. With the GPU's busy share sampled by NVML meanwhile:
encode close to the wall time and a GPU busy well under 100% mean the host's encoding bounds the
token, not the kernels. `--timeline` adds the GPU's own record of the same tokens (CUPTI, through
PyTorch's profiler: harness.tools.gpu_trace): each token's span on the GPU, its kernels' time and the
gaps between them, and the time of each kernel in the loop as it runs there (Nsight Compute's
times are of kernels run one at a time, between which the GPU idles and its clock drops). The
tracer slows the host's encoding, so read the wall time from a run without it.

`--prompt N` times a prompt of N tokens instead (llama-bench's pp, at `--depth`), `--tokens`
times at one position, the way `lathe decode` runs it in `--mode` (the compiled modes: the
decoder's compiled prompt, one mx.compile trace a length and position, replayed; step: forward()
eagerly): its host split (`build`, the prompt's graph, its plan's Python eagerly or the compiled
function's replay; `encode`; `wait`) and, with `--timeline`, its kernels: what a prompt's tok/s is
made of.

`--seams-ab ROUNDS` builds the fused decoder twice in one process, without seams and with them
(kernels.gemv.seam), and alternates the decode matrix's own tg128 (harness.program.decode.generate,
compiled-pipelined) between the two for ROUNDS rounds: the host's speed, which differs from one
process to the next by more than the seams change, is then the same for both.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from harness.tools import gpu_trace
from harness.tools.gpu_trace import Kernel

MARKER = "scan"  # the marker launch's kernel name contains it; nothing in a decode step does
# ncu writes either spelling, depending on its version
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
         "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def _marker() -> None:
    import mlx.core as mx

    mx.eval(mx.cumsum(mx.arange(7, dtype=mx.float32)))


def run(preset: str, qtype: str, variant: str, mode: str, tokens: int, marked: bool, steps: int) -> None:
    import mlx.core as mx

    from harness.program.decode import make_decoder, model_file
    from harness.program.models import load_gguf
    from kernels.runtime import index

    model = load_gguf(model_file(preset, qtype))
    c = model.config
    n = steps if marked else tokens
    decoder = make_decoder(model, 16 + n + 8, variant)
    prompt = np.random.default_rng(0).integers(0, c.vocab, 16)
    token = decoder.greedy(decoder.forward(prompt))
    mx.eval(token)
    fn = decoder.compiled_step() if mode == "compiled" else None

    def step(token):
        if fn is None:
            logits = decoder.forward(token)
        else:
            logits, *caches = fn(token, index(decoder.pos), *decoder.cache_arrays())
            decoder.take_caches(caches)
            decoder.pos += 1
        nxt = decoder.greedy(logits)
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


def _busy_sampler():
    """(start, stop) of a thread sampling the GPU's busy share (NVML utilization.gpu: the share of
    a sample period with a kernel running) every 20 ms; stop() returns the samples' mean, or None
    without NVML."""
    import threading

    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no NVML (CPU machine, or the package is missing): not measured
        return (lambda: None), (lambda: None)
    samples, done = [], threading.Event()

    def sample():
        while not done.wait(0.02):
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    thread = threading.Thread(target=sample, daemon=True)

    def stop():
        done.set()
        thread.join()
        return float(np.mean(samples[len(samples) // 5:])) if samples else None  # past the ramp

    return thread.start, stop


TOKEN_ENDS = ("ArgMax", "_argmax")  # a token's last kernel: MLX's argmax (reference), ours (alone or in the head)


def summarize_timeline(kernels: list[tuple[float, float, str]], last: tuple[str, ...] = TOKEN_ENDS) -> None:
    """Each token's GPU span (from the end of one token's last kernel, the argmax, to the end of
    the next one's), the kernels' busy time within it and the gaps left; kernel time by name."""
    ends = [i for i, (_, _, name) in enumerate(kernels) if any(mark in name for mark in last)]
    if len(ends) < 3:
        print(f"timeline: {len(ends)} kernels named {' or '.join(last)}: too few to cut into tokens")
        return
    groups = [kernels[a + 1:b + 1] for a, b in zip(ends[:-1], ends[1:])]
    _print_groups("token", groups, [sum(kernels[b][:2]) - sum(kernels[a][:2]) for a, b in zip(ends[:-1], ends[1:])])
    _by_position(kernels, ends)


def _by_position(kernels: list[tuple[float, float, str]], ends: list[int]) -> None:
    """Median time of each kernel by its place in a layer (the same kernel name plays several
    parts, e.g. the QKV and gate+up RMSNorm+GEMVs): the layers are the longest run of a repeated
    sequence of kernels; what comes before and after them (the embedding, the output head, the
    argmax) is listed by its place in the token. Tokens whose kernels differ from the most common sequence
    are left out."""
    tokens = [kernels[a + 1:b + 1] for a, b in zip(ends[:-1], ends[1:])]
    sequences = [tuple(name.split("(")[0] for _, _, name in t) for t in tokens]
    names = max(set(sequences), key=sequences.count)
    kept = [t for t, seq in zip(tokens, sequences) if seq == names]
    def repeats(start: int, p: int) -> int:  # whole layers of p kernels from `start`
        n = 0
        while start + (n + 1) * p <= len(names) and \
                names[start + n * p:start + (n + 1) * p] == names[start:start + p]:
            n += 1
        return n

    # layers: the (start, period) whose repeats cover the most kernels, the shortest among equals
    # (a first layer unlike the rest, e.g. one with an extra launch, is left to the token list)
    choices = [(start, p) for start in range(min(len(names), 16)) for p in range(1, (len(names) - start) // 2 + 1)]
    if not choices:
        return
    first, period = max(choices, key=lambda c: (c[1] * repeats(*c), -c[1], -c[0]))
    layers = repeats(first, period)
    durations = np.array([[d for _, d, _ in t] for t in kept])  # [tokens, kernels]
    print(f"by position over {len(kept)} tokens ({layers} layers of {period} kernels; medians):")
    for j in range(period):
        cols = [first + layer * period + j for layer in range(layers)]
        print(f"  layer slot {j}: {names[first + j][:68]:68s} {np.median(durations[:, cols]):8.2f} us")
    for i in [*range(first), *range(first + layers * period, len(names))]:
        print(f"  token kernel {i}: {names[i][:66]:66s} {np.median(durations[:, i]):8.2f} us")


def run_pipelined(preset: str, qtype: str, variant: str, tokens: int,
                  timeline: Path | None = None, depth: int = 0) -> None:
    """Compiled-pipelined decode of `tokens` tokens, each token's host time split (module doc);
    with `timeline`, the GPU's kernel timeline of the timed tokens too; `depth`: that many
    random tokens in the cache before the 16-token prompt (llama-bench's -d)."""
    import mlx.core as mx

    from harness.program.decode import make_decoder, model_file
    from harness.decode_bench import dispatches_per_token
    from harness.program.models import load_gguf
    from kernels.runtime import index

    model = load_gguf(model_file(preset, qtype))
    c = model.config
    decoder = make_decoder(model, depth + 16 + tokens + 16, variant)
    prompt = np.random.default_rng(0).integers(0, c.vocab, depth + 16)
    token = decoder.greedy(decoder.forward(prompt))
    mx.eval(token, decoder.cache_arrays())
    fn = decoder.compiled_step(ordered=True)
    parts = defaultdict(list)

    def queue(token):
        t0 = time.perf_counter()
        logits, *caches = fn(token, index(decoder.pos), *decoder.cache_arrays())
        decoder.take_caches(caches)
        decoder.pos += 1
        nxt = decoder.greedy(logits)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        parts["call"].append(t1 - t0)
        parts["encode"].append(time.perf_counter() - t1)
        return nxt

    def read(token):  # a function of its own, so that a profile can tell the wait (host_profile)
        t0 = time.perf_counter()
        token.item()
        parts["wait"].append(time.perf_counter() - t0)

    for _ in range(6):  # warm-up: compilation and first-use costs
        token = queue(token)
    mx.eval(token)
    parts.clear()
    if timeline and not gpu_trace.available():
        raise SystemExit("--timeline needs the CUDA backend and PyTorch (its profiler reads CUPTI)")
    print(f"timing {tokens} tokens", flush=True)  # the warm-up is over (harness.tools.host_profile waits for it)
    start_busy, stop_busy = _busy_sampler()
    trace = gpu_trace.kernel_trace(timeline) if timeline else contextlib.nullcontext([])
    with trace as kernels:
        start_busy()
        start = time.perf_counter()
        for _ in range(tokens):
            following = queue(token)
            read(token)
            token = following
        mx.eval(token)
        wall = (time.perf_counter() - start) / tokens
        busy = stop_busy()
    split = ", ".join(f"{k} {1e3 * float(np.mean(v)):.3f}" for k, v in parts.items())
    print(f"{preset} {qtype} {variant} compiled-pipelined: {1e3 * wall:.3f} ms per token over {tokens} "
          f"(host ms per token: {split}); GPU busy {'n/a' if busy is None else f'{busy:.0f}%'}; "
          f"{dispatches_per_token(decoder, decoder.pos - 1, 'compiled-pipelined')} dispatches a token "
          f"({len(decoder.plan)} plan steps){', under the kernel tracer' if timeline else ''}")
    if timeline:
        summarize_timeline(kernels)


def summarize_prompt(kernels: list[Kernel], last: tuple[str, ...] = TOKEN_ENDS) -> None:
    """Each prompt's GPU span (its first kernel's start to its argmax's end; the host builds the
    next prompt only after that one, so the time between prompts is not the GPU's), its kernels'
    busy time and gaps, and kernel time by name, a prompt's worth."""
    ends = [i for i, (_, _, name) in enumerate(kernels) if any(mark in name for mark in last)]
    if not ends:
        print(f"timeline: no kernel named {' or '.join(last)}: no prompt to cut out")
        return
    groups = [kernels[a + 1:b + 1] for a, b in zip([-1, *ends[:-1]], ends)]
    _print_groups("prompt", groups, [sum(g[-1][:2]) - g[0][0] for g in groups])


def _print_groups(unit: str, groups: list[list[Kernel]], spans: list[float]) -> None:
    """The median GPU span of `groups` (each a token's or a prompt's kernels), their kernels' busy
    time and the gaps left, and kernel time by name, a `unit`'s worth."""
    busy, by_name = [], defaultdict(list)
    for group in groups:
        busy.append(sum(d for _, d, _ in group))
        for _, d, name in group:
            by_name[name.split("(")[0][:64]].append(d)
    n = len(groups)
    span, work = float(np.median(spans)), float(np.median(busy))
    print(f"timeline over {n} {unit}s: GPU span {span / 1e3:.3f} ms a {unit} (median), kernels "
          f"{work / 1e3:.3f} ms, gaps {(span - work) / 1e3:.3f} ms; {len(groups[0])} kernels a {unit}")
    each, total = f"a {unit}", f"us a {unit}"
    print(f"{'kernel':64s} {each:>{len(each)}s} {'us each':>8s} {total:>{len(total)}s} {'share':>6s}")
    for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:64s} {len(ds) / n:{len(each)}.1f} {np.mean(ds):8.2f} {sum(ds) / n:{len(total)}.1f} "
              f"{100 * sum(ds) / n / span:5.1f}%")


def run_prompt(preset: str, qtype: str, variant: str, prompt: int, repeats: int = 5, depth: int = 0,
               timeline: Path | None = None, settings: tuple[str, ...] = ("",), mode: str = "compiled") -> list[int]:
    """A `prompt`-token prompt after `depth` cached tokens (llama-bench's pp at -d), `repeats`
    times at the same position as `mode` runs it (harness.program.decode.prompt_forward: in the
    compiled modes the decoder's compiled prompt where it has one), each prompt's wall time split
    on the host: `build`, the prompt's graph (forward() replaying the plan, or the compiled
    function's replay); `encode`,
    mx.async_eval of its argmax (MLX encodes every op); `wait`, reading the token. With
    `timeline`, `repeats` more under the kernel tracer, the GPU's kernels of those
    (summarize_prompt). Each of `settings` (option settings, as `--set` takes them; "" for the
    defaults) gets a decoder of its own over the model, loaded once. Returns each timed prompt's
    greedy token (the same every time: the prompt rewrites the same cache rows), setting after
    setting."""
    import mlx.core as mx

    from harness.program.decode import make_decoder, model_file
    from harness.program.models import load_gguf
    from kernels import options

    if timeline and not gpu_trace.available():
        raise SystemExit("--timeline needs the CUDA backend and PyTorch (its profiler reads CUPTI)")
    model = load_gguf(model_file(preset, qtype))
    tokens: list[int] = []
    decoders = []
    for setting in settings:
        with options.use(**options.parse(setting)):
            decoders.append(make_decoder(model, depth + prompt + 1, variant))
    # Every setting untraced first: once the tracer has run, CUPTI stays attached to the process
    # and each launch costs the host more (a Qwen3-0.6B prompt's encode went from 10 to 15 ms)
    for traced in (False, True) if timeline else (False,):
        for setting, decoder in zip(settings, decoders):
            with options.use(**options.parse(setting)):
                tokens += _time_prompts(decoder, f"{preset} {qtype} {variant}", prompt, repeats, depth,
                                        timeline if traced else None, mode)
    return tokens


def _time_prompts(decoder, label: str, prompt: int, repeats: int, depth: int, timeline: Path | None,
                  mode: str = "compiled") -> list[int]:
    """run_prompt's timing of one decoder: untraced, or traced with `timeline`."""
    import mlx.core as mx

    from harness.program.decode import prompt_forward, prompt_is_compiled
    from kernels import options

    rng = np.random.default_rng(0)  # the same cache and prompt for every setting
    if depth:
        mx.eval(decoder.forward(rng.integers(0, decoder.config.vocab, depth)), decoder.cache_arrays())
    ids = rng.integers(0, decoder.config.vocab, prompt)
    parts = defaultdict(list)
    tokens: list[int] = []

    def once() -> float:
        decoder.pos = depth  # the same rows again: the prompt overwrites what it wrote last time
        t0 = time.perf_counter()
        token = decoder.greedy(prompt_forward(decoder, ids, mode, last_only=True))  # as generate() runs it
        t1 = time.perf_counter()
        mx.async_eval(token)
        t2 = time.perf_counter()
        tokens.append(int(token.item()))
        t3 = time.perf_counter()
        parts["build"].append(t1 - t0)
        parts["encode"].append(t2 - t1)
        parts["wait"].append(t3 - t2)
        return t3 - t0

    once()  # warm-up: the prompt phase's plan, kernels and MLX's matmuls at this shape
    parts.clear()
    print(f"timing {repeats} prompts", flush=True)  # (harness.tools.host_profile --prompt waits for it)
    with gpu_trace.kernel_trace(timeline) if timeline else contextlib.nullcontext([]) as kernels:
        walls = [once() for _ in range(repeats)]
    wall = float(np.median(walls))
    split = ", ".join(f"{k} {1e3 * float(np.median(v)):.3f}" for k, v in parts.items())
    how = "compiled" if prompt_is_compiled(decoder, mode) else "eager"
    print(f"{label} prompt {prompt} at depth {depth} ({how}): {1e3 * wall:.3f} ms a prompt, "
          f"{prompt / wall:.1f} tok/s (median of {repeats}; host ms: {split})"
          f"{', under the kernel tracer' if timeline else ''}; options: {options.describe() or 'defaults'}")
    if timeline:
        summarize_prompt(kernels)
    return tokens[1:]


def seams_ab(preset: str, qtype: str, rounds: int, prompt: int = 16, gen: int = 128) -> None:
    """The fused decoder without seams and with them, side by side in one process: tg128 after a
    `prompt`-token prompt, compiled-pipelined, alternated (which goes first swaps each round)."""
    from harness.program.decode import generate, make_decoder, model_file
    from harness.program.models import load_gguf
    from kernels import options

    model = load_gguf(model_file(preset, qtype))
    decoders = {}
    for seams in (False, True):
        with options.use(seams=seams):  # read when the decoder is built
            decoders[seams] = make_decoder(model, prompt + gen, "fused")
    if not decoders[True].seams:
        raise SystemExit(f"{preset} {qtype}: seams do not apply (kernel_decode.seams_apply)")
    tokens = np.random.default_rng(0).integers(0, model.config.vocab, prompt)
    for decoder in decoders.values():  # warm-up: compilation and first-use costs
        decoder.reset()
        generate(decoder, tokens[:4], 2, "compiled-pipelined")
    tok_s = {False: [], True: []}
    outputs = {}
    for r in range(rounds):
        for seams in (False, True) if r % 2 == 0 else (True, False):
            decoders[seams].reset()
            run = generate(decoders[seams], tokens, gen, "compiled-pipelined")
            tok_s[seams].append(run.decode_tok_s)
            outputs[seams] = run.generated
        print(f"round {r}: without seams {tok_s[False][-1]:.1f} tok/s, with seams {tok_s[True][-1]:.1f} tok/s")
    off, on = (float(np.median(tok_s[s])) for s in (False, True))
    print(f"{preset} {qtype} fused compiled-pipelined tg{gen}, medians over {rounds} rounds: without seams "
          f"{off:.1f} tok/s ({len(decoders[False].plan)} dispatches), with seams {on:.1f} tok/s "
          f"({len(decoders[True].plan)} dispatches): {on / off:.3f}x; same greedy tokens: "
          f"{outputs[False] == outputs[True]}")


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
    parser = argparse.ArgumentParser(prog="python -m harness.tools.profile_decode")
    parser.add_argument("model", nargs="?", default="tiny-llama")
    parser.add_argument("--qtype", default="q4_0")
    parser.add_argument("--variant", default="fused")
    parser.add_argument("--mode", default="compiled", choices=("step", "compiled", "compiled-pipelined"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--marked", action="store_true", help="marker launches around each step (for ncu)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--summarize", type=Path, help="an ncu CSV of a --marked run")
    parser.add_argument("--read-timeline", type=Path, help="summarize a Chrome trace that "
                        "--timeline wrote")
    parser.add_argument("--timeline", type=Path, help="compiled-pipelined: trace the GPU's kernels "
                        "(CUPTI, through PyTorch's profiler) into this Chrome trace and summarize it")
    parser.add_argument("--depth", type=int, default=0, help="compiled-pipelined and --prompt: tokens in "
                        "the cache before the prompt")
    parser.add_argument("--seams-ab", type=int, metavar="ROUNDS", help="tg128 without seams and with "
                        "them, alternated in one process for ROUNDS rounds")
    parser.add_argument("--prompt", type=int, help="time a prompt of this many tokens instead (at "
                        "--depth, --tokens times, as --mode runs it: compiled or eager): its host "
                        "split, and with --timeline its kernels")
    parser.add_argument("--settings", default="", help="--prompt: option settings to time one after "
                        "the other in this process, ';' between them ('' the defaults), e.g. "
                        "';prompt_weights=f16' (the prompt's logits: its last row's, as generate() asks)")
    args = parser.parse_args(argv)
    if args.prompt:
        run_prompt(args.model, args.qtype, args.variant, args.prompt, args.tokens, args.depth, args.timeline,
                   tuple(args.settings.split(";")), args.mode)
    elif args.seams_ab:
        seams_ab(args.model, args.qtype, args.seams_ab)
    elif args.summarize:
        summarize(args.summarize)
    elif args.read_timeline:
        summarize_timeline(gpu_trace.read_trace(args.read_timeline))
    elif args.timeline and args.mode != "compiled-pipelined":
        parser.error("--timeline traces the compiled-pipelined mode only")
    elif args.mode == "compiled-pipelined":
        run_pipelined(args.model, args.qtype, args.variant, args.tokens, args.timeline, args.depth)
    else:
        run(args.model, args.qtype, args.variant, args.mode, args.tokens, args.marked, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
