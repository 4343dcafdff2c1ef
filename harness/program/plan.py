"""A decode plan: the ordered steps a token replays (the seeds' dispatch table), each naming its
op, what carries it out, the buffers it reads and writes, the weights bound to it and the fields
that change from token to token. Every variant builds one (harness.program.decode.reference_plan,
harness.program.kernel_decode.kernel_plan) and `lathe decode --show-plan` prints it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Step:
    """One dispatch of a decode step (the seeds' command list): the op, what carries it out, the
    buffers it reads and writes, the weights bound to it, and the fields that change from token
    to token (pos: the position; kv_len: how much of the cache attention reads).

    A kernel variant's step also carries what executes it, `run(decoder, env, t, pos)` (env: the
    named buffers of the token so far), and `launches`: the name prefixes of the lathe kernels
    it may launch (none: MLX ops only), which a CPU test holds against the launches it makes."""

    op: str
    kernel: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    weights: tuple[str, ...] = ()
    per_token: tuple[str, ...] = ()
    layer: int | None = None
    run: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    launches: tuple[str, ...] = field(default=(), compare=False)


def replay(plan: list[Step], decoder: Any, env: dict, t: int, pos: Any) -> dict:
    """Execute a kernel variant's plan for t tokens at position pos: each step in order."""
    for step in plan:
        step.run(decoder, env, t, pos)
    return env


def distinct_layers(plan: list[Step]) -> tuple[int, ...]:
    """The first layer of each distinct sequence of steps (ops and kernels): a file whose layers
    differ (llama.cpp's Q4_K_M gives some layers a Q6_K attn_v) shows one of each kind."""
    seen, shown = set(), []
    for layer in sorted({s.layer for s in plan if s.layer is not None}):
        key = tuple((s.op, s.kernel) for s in plan if s.layer == layer)
        if key not in seen:
            seen.add(key)
            shown.append(layer)
    return tuple(shown) or (0,)


def plan_table(plan: list[Step], layers: tuple[int, ...] = (0,)) -> str:
    """The plan as a readable table (the steps outside the layers and those of `layers`), and
    the dispatches per token."""
    import pandas as pd

    rows = [dict(step=n, layer="" if s.layer is None else s.layer, op=s.op, kernel=s.kernel,
                 reads=",".join(s.reads), writes=",".join(s.writes),
                 weights=",".join(w.removeprefix(f"blk.{s.layer}.") for w in s.weights),
                 per_token=",".join(s.per_token))
            for n, s in enumerate(plan) if s.layer is None or s.layer in layers]
    layer_count = len({s.layer for s in plan if s.layer is not None})
    per_layer = sum(1 for s in plan if s.layer == layer_count - 1)  # the last (the first may differ)
    with pd.option_context("display.width", 250, "display.max_colwidth", 60):
        table = pd.DataFrame(rows).to_string(index=False)
    shown = "layer 0" if layers == (0,) else "layers " + ", ".join(map(str, layers))
    return (f"{table}\n({shown} shown; {per_layer} steps a layer x {layer_count} layers; "
            f"{len(plan)} steps per token: one dispatch each for our kernels, while an MLX op of "
            f"the reference variant may launch more than one kernel)")
