"""The token block's registers, local memory and threadgroups an SM, as the compiler that runs it
leaves them.

    python -m harness.tools.block_registers llama3-8b --qtype q4_0 --context 200,4300
    python -m harness.tools.block_registers qwen3-0.6b --context 4300 --ab "" --ab block_min_groups=4
    python -m harness.tools.block_registers qwen3-0.6b --context 200,1100 --batch 8   # serve's step of 8

A megafused token is one launch whose tickets run as many at once as an SM holds threadgroups of
it (block_grid=resident), and its registers decide how many that is. One register too many can
cost a quarter of the tickets: the 8B's split token block at 131 registers ran 3 an SM and its
down phase in two waves (kernels/loop/NOTES.md, "The token block held to 4 threadgroups an SM").

The token's launches are recorded, not run (kernels.runtime.recording), from a 2-layer file of the
preset's widths decoding at each context length (a cache of that many rows, the position 60 rows
before its end: the attention phase splits from 512 rows), under each option set: the plain module
and the timeline's stamped one (block_timeline's). `--batch N`: serve's megafused step of N
sequences instead (token_block's batch form over a paged pool, block_timeline's BatchSteps), each
sequence at that position.

- On a CUDA machine each module is compiled into the kernel cache as MLX's process would compile
  it (kernels.jit_cache: MLX's device headers, the NVRTC the process loads) and the driver reads
  the cubin: registers, local memory (bytes a thread: the stack and any spills), static shared
  memory, threadgroups an SM (the occupancy calculator).
- Elsewhere NVRTC on this machine, with ptxas' log (harness.nvrtc.resource_table): a guide only.
  On the H200 its counts differed from the device's by up to 29 registers either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

STAMPED, PLAIN = "stamped", "plain"


def token_block_launches(preset: str, qtype: str, context: int, setting: dict | None = None,
                         batch: int = 0) -> list[tuple[str, object]]:
    """(plain or stamped, the launch) of each distinct token_block module of a decode token of a
    2-layer file of `preset`'s widths over a cache of `context` rows, recorded under `setting`;
    `batch` > 0: of serve's megafused step of that many sequences over a paged pool."""
    from harness.program.models import PRESETS, load_gguf, write_random_gguf
    from harness.tools.block_timeline import BatchSteps, OneSequence
    from kernels import options
    from kernels.runtime import recording

    if preset not in PRESETS:
        raise SystemExit(f"block_registers: unknown preset {preset!r}; one of {', '.join(sorted(PRESETS))}")
    if not 64 <= context <= PRESETS[preset].ctx:
        raise SystemExit(f"block_registers: a context of 64..{PRESETS[preset].ctx} rows ({preset}'s), got {context}")
    # a vocabulary past the recorded prompt's ids: a recorded argmax is no token of the model's
    config = dataclasses.replace(PRESETS[preset], n_layers=2, vocab=max(8192, context))
    with tempfile.TemporaryDirectory() as tmp:
        model = load_gguf(write_random_gguf(str(Path(tmp) / "two-layers.gguf"), config, qtype))
        with options.use(**(setting or {})), recording() as rec:
            prompt = context - 60
            seq = BatchSteps(model, batch, prompt, context) if batch else OneSequence(model, prompt, context)
            seq.step()
            seq.timeline = []  # the next token's launch stamped
            seq.step()
            seq.timeline = None
    found: dict = {}
    for job in rec.jobs:
        if "token_block" in job.spec.name:
            kind = STAMPED if "_timeline" in job.spec.name else PLAIN
            found.setdefault((job.spec, tuple(job.constants.items())), (kind, job))
    return list(found.values())


def device_row(job) -> dict:
    """The driver's reading of `job`'s module, compiled into the kernel cache first (CUDA)."""
    from kernels import jit_cache, runtime

    inst = runtime.instance(job)
    log = jit_cache.ensure(inst)
    path = jit_cache.cached(inst)
    if path is None:
        raise SystemExit(f"block_registers: {job.spec.name} is not in the kernel cache{': ' + log if log else ''}")
    cubin, symbol = path.read_bytes(), jit_cache.module_symbol(path)
    threads = job.threadgroup[0] * job.threadgroup[1] * job.threadgroup[2]
    return dict(**jit_cache.function_attributes(cubin, symbol), threads=threads,
                per_sm=jit_cache.groups_per_sm(cubin, symbol, threads), read="device cubin")


def local_row(job) -> dict:
    """ptxas' reading (NVRTC on this machine, sm_90) of `job`'s module."""
    from harness.nvrtc import resource_table

    (row,) = resource_table([job])
    return dict(registers=row["registers"], smem=row["smem"], spill_bytes=row["spill_stores"] + row["spill_loads"],
                threads=row["threads"], per_sm=row["per_sm"], read="NVRTC here (a guide)")


def rows(preset: str, qtype: str, contexts: list[int], settings: list[str], batch: int = 0) -> list[dict]:
    from kernels import options, runtime

    on_device = runtime.backend() == "cuda"
    out = []
    for text in settings:
        setting = options.parse(text)
        for context in contexts:
            for kind, job in token_block_launches(preset, qtype, context, setting, batch):
                c = job.constants
                bounds = job.spec.launch_bounds
                out.append(dict(preset=preset, qtype=qtype, context=context, sequences=batch or 1,
                                options=text or "defaults",
                                module=kind, split=int("_split" in job.spec.name),
                                **{k: int(c[k]) for k in ("XCHUNK", "KSLOTS", "KIN_X", "MMA") if k in c},
                                bounds=f"{bounds[0]}x{bounds[1]}" if bounds else "-",
                                **(device_row(job) if on_device else local_row(job))))
    return out


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    p = argparse.ArgumentParser(prog="python -m harness.tools.block_registers", description=__doc__.split("\n")[0])
    p.add_argument("preset", help="a preset of `lathe decode` (its widths, two layers)")
    p.add_argument("--qtype", default="q8_0")
    p.add_argument("--context", default="200,4300", help="cache rows, comma-separated (split from 512)")
    p.add_argument("--ab", action="append", default=None, metavar="NAME=VALUE[,...]",
                   help="an option set to read the modules under ('' the defaults); repeat for more")
    p.add_argument("--batch", type=int, default=0,
                   help="serve's megafused step of this many sequences (token_block's batch form); 0: one token")
    a = p.parse_args(argv)
    try:
        table = pd.DataFrame(rows(a.preset, a.qtype, [int(n) for n in a.context.split(",")], a.ab or [""],
                                  a.batch))
    except (FileNotFoundError, OSError) as exc:  # no GPU, and no NVRTC or CUDA headers here
        print(f"block_registers: neither a CUDA device nor NVRTC here ({exc})")
        return 2
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
