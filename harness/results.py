"""Result rows and the CSV files that hold them.

Every benchmark family writes one CSV per (device, family) with a fixed
schema: the common columns followed by the family's shape columns. The
schema is checked on every append so that files never mix layouts.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

COMMON_COLUMNS: list[str] = [
    "benchmark", "kernel", "variant", "backend", "device",
    "us", "us_min", "us_max", "gbs", "pct_peak", "peak_gbs",
    "bytes", "flops", "launches", "repeats", "rel_err", "compile_s", "host_us", "gpu_us",
    "gpu_kernels",  # gpu_us by kernel: "name=us;name=us" per call (harness.timing.kernel_split)
    "mlx_version", "git_sha", "date",
    "options",  # kernels.options that differed from their defaults in the run ("" when none)
]

SHAPE_COLUMNS: dict[str, list[str]] = {
    "rope": ["seq", "head_dim", "n_heads", "n_kv_heads"],
    "gemv": ["M", "N", "K"],
    # tokens, pos: a prompt's query tokens and where they start (attention-prefill rows)
    "attention": ["batch", "ctx", "n_heads", "n_kv_heads", "head_dim", "block_size", "tokens", "pos"],
    "loop": ["M", "K", "F", "V", "T"],
    "launch": ["n"],
    # the layer blocks (kernels.blocks) and the fused launches they replace, per model's shapes
    "blocks": ["ctx", "d_model", "F", "heads", "D", "qtype"],
    # "variant" is already a common column; columns() drops the repeat.
    # round: the alternation round of a run with a peer (lathe and llama.cpp take turns);
    # x_llama_cpp: a lathe row's tok/s over llama.cpp's row of the same run and round;
    # peer_build: the peer's own build (llama-bench's build_commit and build_number).
    # error: why a variant of the matrix did not run (its row has no timings); the matrix goes on
    "decode": ["model", "qtype", "variant", "mode", "depth", "prompt", "gen",
               "prefill_tok_s", "decode_tok_s", "ms_per_token",
               "dispatches_per_token", "pct_roofline", "round", "x_llama_cpp", "peer_build", "error"],
    "peak": ["nbytes"],
    # inside a megafused token (harness.tools.block_timeline): a row a phase kind (QKV .. DOWN;
    # medians over layers and tokens; us: its span, us_min / us_max over its phases) and one for
    # the whole launch (phase "token"); lag: the signal's way from the phase before, body: once
    # let go, tail: the slowest tickets past the median one, work / wait: a ticket's, share: of the
    # token's time, start: the median ticket's let-go past the phase before (added after 6ffc3b9);
    # sequences: a serve step's (token_block's batch form over the paged pool), empty for one
    # sequence over the contiguous cache (added after acfb0b7)
    "timeline": ["model", "qtype", "depth", "phase", "layers", "tickets", "lag_us", "body_us", "tail_us",
                 "work_us", "wait_us", "share", "round", "start_us", "sequences"],
    # lathe quality: a text's perplexity per variant (and llama.cpp's, variant "llama.cpp"), each
    # GPU variant's KL divergence from the reference and top-token agreement on the same tokens;
    # us: a chunk's evaluation, wall time; x_llama_cpp: ppl over llama.cpp's ppl of the same run
    "quality": ["model", "qtype", "text", "n_ctx", "chunks", "tokens_scored", "ppl", "ppl_err",
                "kl_mean", "kl_p99", "same_top", "x_llama_cpp", "peer_build"],
    # lathe serve (harness.serve_bench): `batch` requests of `prompt` tokens (the first `shared`
    # common to all; mixed 1: lengths and arrivals drawn, see Workload) generating `gen` each;
    # tok_s over the whole run, decode_tok_s over the decode-only steps (llama-batched-bench's
    # S_TG), prefill_tok_s over the steps that ran prompts (its S_PP); time to first token and
    # per output token in ms; occupancy: the share of the pool's blocks held; mega_steps: the share
    # of decode-only steps the megafused variant ran in token_block's batch form, not fused's plan
    # (serve_mega_up_to, serve_mega_extra), empty for the other variants (added after 39eb34a)
    "serve": ["model", "qtype", "batch", "prompt", "gen", "shared", "mixed", "steps", "tok_s", "decode_tok_s",
              "prefill_tok_s", "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "tpot_ms_p99",
              "occupancy_max", "occupancy_mean", "preempted", "round", "x_llama_cpp", "peer_build", "error",
              "mega_steps"],
}

# Columns a row may leave out; they are written as empty cells.
OPTIONAL_COLUMNS: frozenset[str] = frozenset(
    {"rel_err", "compile_s", "host_us", "gpu_us", "gpu_kernels", "flops", "launches", "repeats", "us_min", "us_max",
     "dispatches_per_token", "round", "x_llama_cpp", "peer_build", "options", "tokens", "pos", "error", "start_us",
     "sequences", "mega_steps"}
)

# Text columns: read back as str so e.g. a sha like "1234567" stays text.
_TEXT_COLUMNS = ["benchmark", "kernel", "variant", "backend", "device", "gpu_kernels",
                 "mlx_version", "git_sha", "date", "options", "model", "qtype", "mode", "peer_build", "text", "error"]

_REPO_ROOT = Path(__file__).resolve().parent.parent


def columns(family: str) -> list[str]:
    """Common columns followed by the shape columns of `family`."""
    if family not in SHAPE_COLUMNS:
        raise ValueError(
            f"unknown result family {family!r}; known: {', '.join(sorted(SHAPE_COLUMNS))}"
        )
    return COMMON_COLUMNS + [c for c in SHAPE_COLUMNS[family] if c not in COMMON_COLUMNS]


def device_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': safe as a directory name."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def _git(args: list[str], cwd: Path) -> str:
    out = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=10
    )
    return out.stdout.strip()


def git_sha(root: str | Path | None = None) -> str:
    """Short HEAD sha (+ '-dirty' for uncommitted tracked changes), or 'unknown'.

    The device machine may get the tree without .git: there the caller sets
    LATHE_GIT_SHA to the sha of the tree it sent. Any other failure is
    reported as 'unknown' rather than raised.
    """
    if os.environ.get("LATHE_GIT_SHA"):
        return os.environ["LATHE_GIT_SHA"]
    cwd = Path(root) if root is not None else _REPO_ROOT
    try:
        sha = _git(["rev-parse", "--short", "HEAD"], cwd)
        dirty = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not sha:
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def _mlx_version() -> str:
    try:
        import mlx.core as mx
    except Exception:  # ImportError, or a broken native extension
        return "none"
    return str(getattr(mx, "__version__", "none"))


def run_metadata() -> dict[str, str]:
    """Provenance fields shared by every row of one run."""
    from kernels import options

    return {
        "mlx_version": _mlx_version(),
        "git_sha": git_sha(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "options": options.describe(),
    }


def _check_row(row: Mapping[str, Any], cols: list[str], index: int) -> dict[str, Any]:
    unknown = [k for k in row if k not in cols]
    if unknown:
        raise ValueError(f"row {index}: unknown column(s) {unknown}; allowed: {cols}")
    missing = [c for c in cols if c not in row and c not in OPTIONAL_COLUMNS]
    if missing:
        raise ValueError(f"row {index}: missing required column(s) {missing}")
    return {c: row.get(c) for c in cols}  # csv writes None as an empty cell


def _schema_diff(found: list[str], expected: list[str]) -> str:
    missing = [c for c in expected if c not in found]
    extra = [c for c in found if c not in expected]
    parts = []
    if missing:
        parts.append(f"missing from file: {missing}")
    if extra:
        parts.append(f"not in schema: {extra}")
    if not parts:
        parts.append("same columns in a different order")
    return "; ".join(parts)


def _upgrade(path: Path, header: list[str], cols: list[str]) -> bool:
    """Rewrite a CSV written under an older schema with the columns added since (left empty),
    when those are all optional and the old ones keep their order; False if it cannot be."""
    added = [c for c in cols if c not in header]
    if not added or [c for c in cols if c in header] != header or not set(added) <= OPTIONAL_COLUMNS:
        return False
    with path.open(newline="") as f:
        old = list(csv.DictReader(f))
    tmp = path.with_suffix(".upgrade")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(old)
    tmp.replace(path)
    return True


def append_rows(path: str | Path, family: str, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Validate `rows` against the family schema and append them to the CSV at `path`."""
    path = Path(path)
    cols = columns(family)
    checked = [_check_row(r, cols, i) for i, r in enumerate(rows)]

    # An existing file must have exactly this schema, or rows would be misaligned; a file of an
    # older schema that lacks only optional columns is rewritten with them (empty) first.
    new_file = not path.exists() or path.stat().st_size == 0
    if not new_file:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != cols and not _upgrade(path, header, cols):
            raise ValueError(
                f"schema changed for {path} (family {family!r}): {_schema_diff(header, cols)}"
            )

    if not checked:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        if new_file:
            writer.writeheader()
        writer.writerows(checked)
    return path


def results_dir(root: str | Path, device_name: str) -> Path:
    """Directory holding one device's CSV files."""
    return Path(root) / "results" / device_slug(device_name)


def read_results(path: str | Path) -> pd.DataFrame:
    """Load a results CSV; text columns stay text, empty cells become NaN."""
    path = Path(path)
    with path.open(newline="") as f:
        header = next(csv.reader(f), [])
    dtypes = {c: str for c in _TEXT_COLUMNS if c in header}
    return pd.read_csv(path, dtype=dtypes)


def backend_line() -> str:
    """The first line every command prints: MLX, its backend and device, the options set."""
    import mlx.core as mx

    from kernels import options
    from kernels.runtime import backend, device_name

    changed = options.describe()
    return (f"lathe: mlx {mx.__version__}, backend {backend()}, device {device_name()}"
            + (f", options {changed}" if changed else ""))


def no_gpu_notice() -> None:
    from kernels.runtime import NoGpuBackend

    print(f"{NoGpuBackend()}\nRunning the reference checks only.", flush=True)
