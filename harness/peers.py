"""Peers timed by the workbench itself, in the same run, on the same file and GPU: llama.cpp's
`llama-bench`.

`lathe decode ... --peer llama.cpp` runs llama-bench on the very GGUF file lathe decodes, with the
same prompt, generation length, depths and repeats (`-p PROMPT -n GEN -d DEPTHS -r R -fa 1 -o
json`: llama-bench times the prompt and the generation as two tests, each after DEPTH tokens
already in the context), taking turns with lathe's own timings round by round so that drift
between them shows. Its tests become decode.csv rows of variant `llama.cpp`, and each lathe row's
`x_llama_cpp` is its tok/s over the llama.cpp row of the same run and round. The figures of
harness/anchors.py (another day, another machine of the kind) are only a labelled fallback for
when no llama-bench is found.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PEERS = ("llama.cpp",)
VARIANT = "llama.cpp"  # the rows' variant
MODE = "llama-bench"  # the rows' mode: llama.cpp's own loop, flash attention on

HOW_TO_GET = ("no llama-bench found (PATH or $LLAMA_BENCH): build llama.cpp's with `cmake -B build "
              "[-DGGML_CUDA=ON] && cmake --build build --target llama-bench` (on the lent device: "
              "`bash .ci/device llama-bench`) and put build/bin on PATH or set LLAMA_BENCH")


class PeerError(RuntimeError):
    """The peer could not be run, or said something we cannot read."""


def _given(variable: str) -> str | None:
    """The executable an environment variable names, checked; None where it is unset."""
    given = os.environ.get(variable)
    if given and not (Path(given).is_file() and os.access(given, os.X_OK)):
        raise PeerError(f"{variable}={given} is not an executable file")
    return given or None


def find_llama_bench() -> str | None:
    """llama-bench's path: $LLAMA_BENCH when set (it must be an executable file), else PATH."""
    return _given("LLAMA_BENCH") or shutil.which("llama-bench")


@dataclass(frozen=True)
class LlamaBench:
    """One llama-bench executable and the arguments every run of it shares."""

    path: str
    timeout_s: float = 900.0

    def command(self, model: Path, prompt: int, gen: int, depths: Sequence[int], repeat: int) -> list[str]:
        return [self.path, "-m", str(model), "-p", str(prompt), "-n", str(gen),
                "-d", ",".join(str(d) for d in depths), "-r", str(repeat), "-fa", "1", "-o", "json"]

    def run(self, model: Path, prompt: int, gen: int, depths: Sequence[int], repeat: int) -> list[dict]:
        """llama-bench's JSON tests for this file and matrix (one model load for all of them)."""
        return parse_tests(run_tool("llama-bench", self.command(model, prompt, gen, depths, repeat),
                                    self.timeout_s).stdout)


def run_tool(name: str, cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """A peer's run, its failure a PeerError with the command and the last lines it printed."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"{name} ran past {timeout_s:.0f} s: {' '.join(cmd)}") from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise PeerError(f"{name} exited {done.returncode}: {' '.join(cmd)}\n{tail}")
    return done


def parse_tests(text: str) -> list[dict]:
    """llama-bench's `-o json` output: a list of tests, each with n_prompt, n_gen, n_depth,
    avg_ts, stddev_ts, samples_ts, build_commit, build_number, backends."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PeerError(f"llama-bench's output is not JSON ({exc}): {text[:200]!r}") from exc
    need = {"n_prompt", "n_gen", "n_depth", "avg_ts", "samples_ts", "build_commit", "backends"}
    if not isinstance(tests, list) or not all(isinstance(t, dict) and need <= t.keys() for t in tests):
        raise PeerError(f"llama-bench's JSON is not a list of tests with {sorted(need)}")
    return tests


def peer_rows(tests: list[dict], prompt: int, gen: int, depths: Sequence[int], common: dict,
              roofline) -> list[dict]:
    """One row per depth in run_decode's fields: tok/s of the generation test (its spread from
    the samples), the prompt test's tok/s as prefill_tok_s. `common` holds the fields shared with
    the lathe rows of the run (model, qtype, size, repeat, round); `roofline(position, tok_s)`
    gives the traffic fields at a mean decode position, counted as for lathe's rows."""
    rows = []
    for depth in depths:
        tg = _one(tests, 0, gen, depth)
        pp = _one(tests, prompt, 0, depth)
        samples = [float(s) for s in tg["samples_ts"]] or [float(tg["avg_ts"])]
        tok_s = float(tg["avg_ts"])
        rows.append(dict(
            common, backend=str(tg["backends"]), variant=VARIANT, mode=MODE,
            test=f"pp{prompt}+tg{gen}" + (f" @ d{depth}" if depth else ""), depth=depth,
            prompt=prompt, gen=gen, prefill_tok_s=round(float(pp["avg_ts"]), 1),
            decode_tok_s=round(tok_s, 1), decode_tok_s_std=round(float(tg.get("stddev_ts", 0.0)), 1),
            ms_per_token=round(1e3 / tok_s, 3), ms_per_token_min=round(1e3 / max(samples), 3),
            ms_per_token_max=round(1e3 / min(samples), 3), peak_memory_mb=None,
            dispatches_per_token=None, compile_s=None,
            peer_build=f"{tg['build_commit']} ({tg.get('build_number', '?')})",
            **roofline(depth + (gen - 1) / 2, tok_s)))  # llama-bench generates right after the depth
    return rows


def _one(tests: list[dict], n_prompt: int, n_gen: int, depth: int) -> dict:
    found = [t for t in tests if (int(t["n_prompt"]), int(t["n_gen"]), int(t["n_depth"])) == (n_prompt, n_gen, depth)]
    if len(found) != 1:
        raise PeerError(f"llama-bench gave {len(found)} tests of n_prompt {n_prompt}, n_gen {n_gen}, "
                        f"n_depth {depth} (expected one)")
    return found[0]


def pair_with_peer(rows: list[dict]) -> list[dict]:
    """Each lathe row's x_llama_cpp: its decode tok/s over the llama.cpp row of the same depth and
    round (rows of one run_decode call, so one run). Rows without such a peer row keep None."""
    peers = {(r["depth"], r.get("round")): r["decode_tok_s"] for r in rows if r["variant"] == VARIANT}
    for r in rows:
        peer = peers.get((r["depth"], r.get("round")))
        r["x_llama_cpp"] = (round(r["decode_tok_s"] / peer, 3)
                            if peer and r["variant"] != VARIANT and r.get("decode_tok_s") is not None else None)
    return rows


# ---- many sequences at once: llama-batched-bench -------------------------------------------------
BATCHED_HOW_TO_GET = ("no llama-batched-bench found (PATH, $LLAMA_BATCHED_BENCH, or beside llama-bench): "
                      "`bash .ci/device llama-bench` builds it with llama-bench")


def find_llama_batched_bench() -> str | None:
    """$LLAMA_BATCHED_BENCH when set (an executable file), else beside llama-bench, else PATH."""
    given = _given("LLAMA_BATCHED_BENCH")
    if given:
        return given
    bench = find_llama_bench()
    beside = Path(bench).with_name("llama-batched-bench") if bench else None
    if beside is not None and beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("llama-batched-bench")


@dataclass(frozen=True)
class LlamaBatchedBench:
    """llama-batched-bench: `batch` sequences of `prompt` random tokens prefilled together, then
    `gen` steps that decode a token of each (flash attention, every layer on the GPU)."""

    path: str
    timeout_s: float = 900.0

    def command(self, model: Path, prompt: int, gen: int, batches: Sequence[int]) -> list[str]:
        ctx = max(batches) * (prompt + gen) + 16
        return [self.path, "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512",
                "-npp", str(prompt), "-ntg", str(gen), "-npl", ",".join(str(b) for b in batches),
                "-ngl", "99", "-fa", "on", "--output-format", "jsonl"]

    @property
    def build(self) -> str:
        """The build as llama-bench's rows name theirs, `commit (number)`, from `--version`."""
        try:
            done = subprocess.run([self.path, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PeerError(f"{self.path} --version: {exc}") from exc
        found = re.search(r"version: (\d+) \((\w+)\)", done.stdout + done.stderr)
        return f"{found.group(2)} ({found.group(1)})" if found else "unknown"

    def run(self, model: Path, prompt: int, gen: int, batches: Sequence[int]) -> list[dict]:
        done = run_tool("llama-batched-bench", self.command(model, prompt, gen, batches), self.timeout_s)
        return parse_batched(done.stdout + "\n" + done.stderr, batches)


def parse_batched(text: str, batches: Sequence[int]) -> list[dict]:
    """llama-batched-bench's `--output-format jsonl` lines (pp, tg, pl, t_pp, speed_pp, t_tg,
    speed_tg, t, speed), one per batch size asked for, in `batches`' order."""
    need = {"pp", "tg", "pl", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed"}
    found = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            test = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(test, dict) and need <= test.keys():
            found[int(test["pl"])] = test
    missing = [b for b in batches if b not in found]
    if missing:
        raise PeerError(f"llama-batched-bench gave no result for batch {missing} (a batch past its context is skipped)")
    return [found[b] for b in batches]
