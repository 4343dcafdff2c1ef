"""Where the host's time of a decode token goes: a sampling profile of the running loop, native
frames included, summarized by function.

    python -m harness.tools.host_profile llama3-8b --qtype q4_0 --variant fused --tokens 1500 --out DIR
    python -m harness.tools.host_profile qwen3-0.6b --qtype q8_0 --serve 8 --tokens 1500 --out DIR
    python -m harness.tools.host_profile --summarize DIR/host-llama3-8b-fused.txt

`--serve N` samples `lathe serve`'s decode-only steps of N sequences instead
(`harness.tools.serve_profile --no-trace`, `--tokens` its steps): a step is one scheduler step.
`--prompt N` samples N-token prompts at depth 0 (`harness.tools.profile_decode --prompt`, compiled
as `lathe decode` runs them, `--tokens` of them): a sample counts where it is under a prompt's
`once` (build, encode, wait).

The first form runs `harness.tools.profile_decode`'s compiled-pipelined loop (module doc there: the
token's host time split into call, encode and wait) and, once its warm-up is over, samples it
for `--seconds` with py-spy (`--native`: MLX's C++ frames,
which libmlx.so names, and the CUDA driver's, which it does not) and writes py-spy's raw
collapsed stacks to DIR; the second reads such a file. py-spy is found on PATH or in $PY_SPY.

The summary keeps the samples of the timed loop's tokens (`queue` and `read` in
`run_pipelined`), leaves out those that compile or trace (the first tokens'), and prints the
share of them under each function (inclusive: a function counts once per sample whatever its
depth), the children of the calls that matter (what `mx.async_eval` spends its time in), and the
leaves (where the CPU is when sampled).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = "run_pipelined"  # the timed loop's function in harness.tools.profile_decode
TOKEN = ("run_pipelined.<locals>.queue", "run_pipelined.<locals>.read")  # a token: queued, read
SERVE_ROOT, SERVE_TOKEN = "_decode_steps", ("Scheduler.step",)  # --serve: harness.tools.serve_profile's
PROMPT_ROOT, PROMPT_TOKEN = "_time_prompts", ("_time_prompts.<locals>.once",)  # --prompt: profile_decode's
WARM_UP = ("compile_trace", "compile_simplify", "nvrtc", "JitModule", "JitCompiler", "trace_impl")  # first tokens
SPLIT_UNDER = ("run_pipelined.<locals>.queue", "_time_prompts.<locals>.once", "mlx::core::async_eval", "mlx::core::eval_impl", "mlx::core::gpu::eval",
               "mlx::core::fast::CustomKernel::eval_gpu", "mlx::core::cu::CommandEncoder::commit")


def frame_name(frame: str) -> str:
    """A readable name: a Python frame as `function (file)`, a C++ one without template or
    argument lists, an unnamed native frame as `[library]`."""
    name, _, where = frame.rpartition(" (")
    where = where.rstrip(")")
    if not name:
        return frame
    if name.startswith("0x"):
        return f"[{where}]"
    if where.endswith(".py") or ".py:" in where:
        return f"{name} ({Path(where.split(':')[0]).name})"
    depth, out = 0, []
    for ch in name:  # drop <...> template arguments, nested
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return re.sub(r"\(.*\)$", "", "".join(out)).strip()


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: one stack a line, frames root first, ';'-separated, then the count."""
    stacks = []
    for line in path.read_text().splitlines():
        body, _, count = line.rpartition(" ")
        if body and count.isdigit():
            stacks.append(([frame_name(f) for f in body.split(";")], int(count)))
    return stacks


def summarize(path: Path, top: int = 25) -> None:
    stacks = read_stacks(path)
    # record()'s names for a --serve and a --prompt profile
    root, token = ((SERVE_ROOT, SERVE_TOKEN) if path.name.startswith("host-serve-") else
                   (PROMPT_ROOT, PROMPT_TOKEN) if path.name.startswith("host-prompt") else (ROOT, TOKEN))

    def in_token(frames: list[str]) -> bool:
        return any(f.startswith(root) for f in frames) and any(f.startswith(token) for f in frames)

    kept = [(frames, n) for frames, n in stacks
            if in_token(frames) and not any(w in f for f in frames for w in WARM_UP)]
    total = sum(n for _, n in kept)
    dropped = sum(n for frames, n in stacks if in_token(frames)) - total
    if not total:
        print(f"{path}: no samples of a token under {root}")
        return
    print(f"{path.name}: {total} samples of the loop's tokens ({dropped} that compiled or traced "
          "left out)")
    inclusive, leaves = Counter(), Counter()
    for frames, n in kept:
        for f in set(frames):
            inclusive[f] += n
        leaves[frames[-1]] += n

    def table(title: str, counts: Counter, of: int) -> None:
        print(f"\n{title}")
        for name, n in counts.most_common(top):
            print(f"  {100 * n / of:5.1f}%  {name[:110]}")

    table("inclusive (share of the loop's samples under each function):", Counter(
        {f: n for f, n in inclusive.items() if not f.startswith(("[", "<module>"))}), total)
    for parent in SPLIT_UNDER:
        children, under = Counter(), 0
        for frames, n in kept:
            idx = [i for i, f in enumerate(frames) if f.startswith(parent)]
            if not idx:
                continue
            under += n
            i = idx[-1]
            children[frames[i + 1] if i + 1 < len(frames) else "(self)"] += n
        if under:
            table(f"under {parent} ({100 * under / total:.1f}% of the loop), by child:", children, under)
    table("leaves (where the sampled thread was):", leaves, total)


def record(preset: str, qtype: str, variant: str, tokens: int, out: Path, rate: int,
           seconds: int, serve: int = 0, sets: str = "", prompt: int = 0) -> Path:
    """Run the loop (`serve`: serve's decode steps of that many sequences) and sample it for
    `seconds` once its warm-up is over (the model's build and the first tokens' compilation,
    which sampling with native frames would slow many times)."""
    spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not spy:
        raise SystemExit("py-spy not found: put it on PATH or name it in $PY_SPY")
    out.mkdir(parents=True, exist_ok=True)
    if serve:
        raw = out / f"host-serve-{preset}-{variant}-{serve}.txt"
        command = ["harness.tools.serve_profile", preset, "--qtype", qtype, "--variant", variant,
                   "--batch", str(serve), "--steps", str(tokens), "--no-trace", "--set", sets]
    elif prompt:
        raw = out / f"host-prompt{prompt}-{preset}-{variant}.txt"
        command = ["harness.tools.profile_decode", preset, "--qtype", qtype, "--variant", variant,
                   "--prompt", str(prompt), "--tokens", str(tokens)]
    else:
        raw = out / f"host-{preset}-{variant}.txt"
        command = ["harness.tools.profile_decode", preset, "--qtype", qtype, "--variant", variant,
                   "--mode", "compiled-pipelined", "--tokens", str(tokens)]
    child = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE, text=True)
    for line in child.stdout:
        print(line, end="", flush=True)
        if line.startswith("timing "):
            break
    else:
        raise SystemExit(f"the loop ended before its timed tokens (exit {child.wait()})")
    try:
        subprocess.run([spy, "record", "--pid", str(child.pid), "--native", "--idle", "-r", str(rate),
                        "-d", str(seconds), "-f", "raw", "-o", str(raw)], check=True)
    except BaseException:
        child.kill()
        raise
    for line in child.stdout:
        print(line, end="", flush=True)
    if child.wait():
        raise SystemExit(f"the loop failed (exit {child.returncode})")
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", nargs="?")
    ap.add_argument("--qtype", default="q4_0")
    ap.add_argument("--variant", default="fused")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--rate", type=int, default=250, help="samples a second")
    ap.add_argument("--seconds", type=int, default=4, help="how long to sample the timed loop")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--serve", type=int, default=0, metavar="N",
                    help="sample lathe serve's decode steps of N sequences, not the decode loop")
    ap.add_argument("--set", default="", metavar="NAME=VALUE[,...]", help="--serve: experiment options")
    ap.add_argument("--prompt", type=int, default=0, metavar="N",
                    help="sample N-token prompts (--tokens of them), not the decode loop")
    ap.add_argument("--summarize", type=Path, help="read a raw py-spy file instead of recording one")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize, a.top)
    elif a.preset:
        summarize(record(a.preset, a.qtype, a.variant, a.tokens, a.out, a.rate, a.seconds, a.serve, a.set, a.prompt), a.top)
    else:
        ap.error("a preset to profile, or --summarize FILE")


if __name__ == "__main__":
    main()
