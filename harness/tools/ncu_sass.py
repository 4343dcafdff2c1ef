"""Where a kernel's warps wait, by instruction: Nsight Compute's source page (SASS with the warp
stall samples of the SourceCounters section) summed by opcode, and the instructions with the
most samples.

    ncu --section SourceCounters --import-source no -f -o rep python -m harness.tools.profile gemv "..."
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m harness.tools.ncu_sass sass.csv [--top 12]

A sample lands on the instruction a warp could not issue, so the samples at the first use of a
load's register are that load's wait (e04a574: half of qmm's at 16 rows sat on the shifts of W's
quant words; kernels/gemv/NOTES.md). Executed counts say what the kernel spends its issue slots
on. ncu writes one block per kernel: a "Kernel Name" line, a header, a row per instruction.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class KernelSass:
    name: str
    rows: list[tuple[str, int, int]] = field(default_factory=list)  # (SASS text, samples, executed)

    def by_opcode(self) -> list[tuple[str, float, float]]:
        """(opcode, share of the stall samples, share of the executed instructions), most sampled
        first; an opcode without its modifiers (HMMA.16816.F32 is HMMA), a predicate skipped."""
        samples, executed = Counter(), Counter()
        for text, s, e in self.rows:
            words = text.split()
            op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]) if words else "?"
            op = op.split(".")[0]
            samples[op] += s
            executed[op] += e
        total_s, total_e = max(1, sum(samples.values())), max(1, sum(executed.values()))
        return [(op, s / total_s, executed[op] / total_e) for op, s in samples.most_common()]

    def top(self, n: int) -> list[tuple[str, int]]:
        return [(text, s) for text, s, _ in sorted(self.rows, key=lambda r: -r[1])[:n]]


def read_sass(path: str | Path) -> list[KernelSass]:
    """The kernels of an `ncu --page source --csv --print-source sass` file, in its order."""
    kernels: list[KernelSass] = []
    header: list[str] | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append(KernelSass(row[1] if len(row) > 1 else "?"))
                header = None
            elif header is None:
                header = row
                if SAMPLES not in header or EXECUTED not in header or "Source" not in header:
                    raise ValueError(f"{path}: not ncu's SASS source page with SourceCounters (no {SAMPLES!r})")
            elif kernels and len(row) == len(header):
                at = {name: row[i] for i, name in enumerate(header)}
                kernels[-1].rows.append((at["Source"].strip(), int(float(at[SAMPLES] or 0)),
                                         int(float(at[EXECUTED] or 0))))
    if not kernels:
        raise ValueError(f"{path}: no kernel in it")
    return kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.tools.ncu_sass")
    parser.add_argument("sass_csv")
    parser.add_argument("--top", type=int, default=12, help="the instructions with the most samples")
    parser.add_argument("--opcodes", type=int, default=14, help="the opcodes shown")
    args = parser.parse_args(argv)
    for kernel in read_sass(args.sass_csv):
        samples = sum(s for _, s, _ in kernel.rows)
        executed = sum(e for _, _, e in kernel.rows)
        print(f"== {kernel.name[:120]}")
        print(f"   {len(kernel.rows)} instructions, {samples} stall samples, {executed} warp instructions executed")
        print(f"   {'opcode':10s} {'samples':>8s} {'executed':>9s}")
        for op, s, e in kernel.by_opcode()[:args.opcodes]:
            print(f"   {op:10s} {s:8.1%} {e:9.1%}")
        print("   most sampled:")
        for text, s in kernel.top(args.top):
            print(f"   {s:8d}  {text[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
