"""What a native kernel's loops are made of, without a GPU: the instance compiled by NVRTC for
sm_90a (kernels.native.cubin), disassembled by cuobjdump, and each loop (a branch back to an
earlier address) counted by opcode. The static counterpart of ncu_sass: it says what one pass of
a loop issues, not where warps wait.

    python -m harness.tools.sass_mix --qmm-mma q4_0,16,28672,4096[,gated][,rows8] [--knob tm=2 ...] [--top 14]
    python -m harness.tools.sass_mix --native gemv/qmm_mma.cu lathe_qmm_mma QT=0 M=16 ...

cuobjdump is CUDA's (pip: nvidia-cuda-cuobjdump); it is looked for on PATH, then in the nvidia
wheels beside the interpreter. A loop nested in another is counted in both; the opcodes are
without their modifiers (HMMA.16816.F32 is HMMA) and predicates. 1966436's read of qmm_mma's
gate+up (kernels/gemv/NOTES.md, "qmm on the warp MMA") is this tool's first use.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b(?:\.\S+)?\s+(?:`\(\S+\)\s*)?(0x[0-9a-f]+)")


@dataclass
class Loop:
    start: int  # the address branched back to
    end: int  # the branch's own address
    ops: Counter

    @property
    def size(self) -> int:
        return sum(self.ops.values())


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of each SASS instruction, in order."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text: str) -> str:
    words = text.split()
    if words and words[0].startswith("@"):  # a predicate
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def loops(sass: str) -> list[Loop]:
    """Each backward branch's span of instructions, counted by opcode, largest first."""
    ins = instructions(sass)
    found = []
    for at, text in ins:
        if opcode(text) != "BRA":
            continue
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= at:
            start = int(m.group(1), 16)
            found.append(Loop(start, at, Counter(opcode(t) for a, t in ins if start <= a <= at)))
    return sorted(found, key=lambda lp: -lp.size)


def cuobjdump() -> str:
    """The cuobjdump binary: PATH, then the nvidia wheels' bin folders."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in map(Path, sys.path):
        for candidate in sorted((root / "nvidia").glob("*/bin/cuobjdump")) if (root / "nvidia").is_dir() else ():
            return str(candidate)
    raise FileNotFoundError("cuobjdump not found (CUDA's; pip install nvidia-cuda-cuobjdump)")


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([cuobjdump(), "-sass", str(path)], check=True, capture_output=True, text=True).stdout


def qmm_mma_constants(spec: str, knobs: list[str]) -> tuple[str, str, dict[str, int]]:
    """kernels.gemv.qmm_mma's instance for 'qtype,m,n,k[,gated][,rows8]' under its launch rule, knobs
    (tm=2 ...) given over it, as qmm_mma() would launch it (the residual and K's parts aside); rows8:
    W as RowBlocks."""
    from kernels import gemv

    qtype, m, n, k, *rest = spec.split(",")
    m, n, k = int(m), int(n), int(k)
    gated, rows8 = bool({"1", "gated"} & set(rest)), "rows8" in rest
    given = {key: int(v) for key, v in (kv.split("=") for kv in knobs)}
    geo = gemv.qmm_mma_launch_knobs(m, n, k, qtype, gated, knobs=given)
    return gemv.QMM_MMA, "lathe_qmm_mma", gemv.qmm_mma_constants(qtype, m, n, k, geo, gated, False, rows8)


def report(sass: str, top: int) -> str:
    lines = []
    for i, lp in enumerate(loops(sass)):
        mix = ", ".join(f"{op} {n}" for op, n in lp.ops.most_common(top))
        lines.append(f"loop {i}: {lp.size} instructions, 0x{lp.start:x}..0x{lp.end:x}: {mix}")
    if not lines:
        total = Counter(opcode(t) for _, t in instructions(sass))
        lines.append(f"no loop; {sum(total.values())} instructions: "
                     + ", ".join(f"{op} {n}" for op, n in total.most_common(top)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--qmm-mma", metavar="QTYPE,M,N,K[,gated][,rows8]",
                       help="qmm_mma's instance under its launch rule")
    which.add_argument("--native", nargs="+", metavar="ARG", help="PATH (under kernels/) STEM NAME=VALUE ...")
    ap.add_argument("--knob", action="append", default=[], help="qmm_mma: a launch knob over the rule (tm=2)")
    ap.add_argument("--top", type=int, default=14, help="opcodes shown a loop")
    args = ap.parse_args(argv)
    if args.qmm_mma:
        path, stem, consts = qmm_mma_constants(args.qmm_mma, args.knob)
    else:
        path, stem, *pairs = args.native
        consts = {key: int(v) for key, v in (p.split("=") for p in pairs)}
    from kernels import native

    print(f"{native.entry_name(stem, consts)} (NVRTC sm_90a)")
    print(report(disassemble(native.cubin(path, stem, tuple(consts.items()))), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
