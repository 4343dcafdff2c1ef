"""Whether a change moved the code that a family's kernels compile to, without a GPU. Each check
case's CUDA modules, recorded as the cases launch them, are compiled to PTX by NVRTC in this tree
and in another revision's. Their kernel names are blanked and they are compared module by module.

    python -m harness.tools.ptx_same blocks --base 4616a53
    python -m harness.tools.ptx_same blocks --base 4616a53 --set block_k_early=off -k token_block

Each module, in launch order, is one of:
- `same`: byte for byte;
- `reordered`: the same lines in another order (the front end scheduled them otherwise, e.g. a
  store moved past the next value's arithmetic); with --commuted, also where two-operand adds
  have their operands the other way round;
- `differs`.

A module's name spells its constants, so a change that adds a constant renames every module that
takes it. The tool blanks the names, and the lengths and hashes that NVRTC derives from them.

The other revision is checked out into a temporary git worktree and recorded there by its own
code; this file runs there as a script. The first change it read was 5d65646's block_k_early
(kernels/loop/NOTES.md, "K's first rounds before the wait"): off, 74 modules, none differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

_MANGLED_LENGTH = re.compile(r"cu[0-9]+KERNEL")  # mlx::core::cu::<length><name> in the symbol
_INTERNAL = re.compile(r"_ZN[0-9]+_INTERNAL_[0-9]+_[0-9]+_KERNEL_[0-9a-f]+")  # NVRTC's per-file internal names
_ANONYMOUS = re.compile(r"N__00000000_[0-9]+_KERNEL_[0-9a-f]+")
_NAMESPACE_LENGTH = re.compile(r"__4[0-9]+_GLOBAL")
_COMMENT = re.compile(r"//.*")
# a two-operand integer or float add, its operands sorted (PTX's `add.s32 %r3, %r2, %r1;`)
_ADD = re.compile(r"^(\s*add\.[a-z0-9.]+\s+%\w+,\s*)(%?\w+),\s*(%?\w+);$")


def normalize(ptx: str, name: str) -> str:
    """The PTX without its kernel's name, what NVRTC derives from the name, and comments."""
    text = ptx.replace(name, "KERNEL")
    for pattern, blank in ((_MANGLED_LENGTH, "cuKERNEL"), (_INTERNAL, "INTERNAL"), (_ANONYMOUS, "N__ANON"),
                           (_NAMESPACE_LENGTH, "__4_GLOBAL"), (_COMMENT, "")):
        text = pattern.sub(blank, text)
    return text


def _commuted(line: str) -> str:
    match = _ADD.match(line)
    return line if match is None else match.group(1) + ", ".join(sorted(match.group(2, 3))) + ";"


def digests(ptx: str, name: str) -> dict[str, str]:
    """Hashes of a module's normalized PTX: whole, its lines sorted, and its lines sorted with
    two-operand adds' operands sorted."""
    text = normalize(ptx, name)
    lines = text.splitlines()
    h = lambda s: hashlib.sha256(s.encode()).hexdigest()[:16]  # noqa: E731
    return dict(exact=h(text), lines=h("\n".join(sorted(lines))),
                commuted=h("\n".join(sorted(_commuted(line) for line in lines))))


def verdict(base: dict, head: dict, commuted: bool = False) -> str:
    if base["exact"] == head["exact"]:
        return "same"
    if base["lines"] == head["lines"] or (commuted and base["commuted"] == head["commuted"]):
        return "reordered"
    return "differs"


def compare(base: list[dict], head: list[dict], commuted: bool = False) -> list[dict]:
    """A row a module position: the two trees' names and the verdict ('missing' where one tree
    recorded fewer modules: the cases launched differently, so positions no longer pair)."""
    rows = []
    for i in range(max(len(base), len(head))):
        b, h = (base[i] if i < len(base) else None), (head[i] if i < len(head) else None)
        rows.append(dict(module=i, base=b and b["name"], head=h and h["name"],
                         verdict="missing" if b is None or h is None else verdict(b, h, commuted)))
    return rows


# ---- recording and compiling, in the tree this file is run in ----------------------------------------
def _compile_one(job: tuple[str, str]) -> dict:
    from kernels import ptx

    name, source = job
    return dict(name=name, **digests(ptx.compile_ptx(source, name, "compute_90").decode(), name))


def module_digests(family: str, match: str | None, setting: dict, jobs: int) -> list[dict]:
    """Each distinct CUDA module of the family's check cases (all of them, or those `match`
    picks), in first-launch order, recorded under `setting` and compiled for compute_90."""
    from harness.check import matches
    from harness.nvrtc import record_instantiations
    from harness.suites import select
    from kernels import options

    (fam,) = [f for f in select(None) if f.name == family]
    cases = [c for c in fam.check_cases(small=False) if match is None or matches(c.id, match)]
    with options.use(**setting):
        instances = record_instantiations(cases)
    work = [(inst.kernel_name, inst.mlx_source()) for inst in instances]
    if jobs <= 1:
        return [_compile_one(w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_one, work))


def _emit(args) -> int:
    from kernels import options

    for row in module_digests(args.family, args.match, options.parse(args.set or ""), args.jobs):
        print(json.dumps(row), flush=True)
    return 0


def _run_emit(tree: Path, args, setting: str | None) -> list[dict]:
    """This file run as a script in `tree` (its own harness and kernels on the path)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--emit", args.family, "--jobs", str(args.jobs)]
    cmd += ["-k", args.match] if args.match else []
    cmd += ["--set", setting] if setting else []
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"ptx_same: recording in {tree} failed:\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.tools.ptx_same", description=__doc__.split("\n\n")[0])
    ap.add_argument("family", help="a family of `lathe check` (blocks, gemv, attention, ...)")
    ap.add_argument("--base", help="the revision to compare this tree with (git)")
    ap.add_argument("-k", dest="match", default=None, help="only cases whose id contains this (|-separated)")
    ap.add_argument("--set", default=None, help="options for this tree's recording (NAME=VALUE,...)")
    ap.add_argument("--base-set", default=None, help="options for the base's recording")
    ap.add_argument("--commuted", action="store_true", help="count adds with swapped operands as reordered")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="NVRTC processes a tree")
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)  # (run in a tree: JSON lines)
    args = ap.parse_args(argv)
    if args.emit:
        return _emit(args)
    if not args.base:
        ap.error("--base REV is needed")
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(other), args.base], check=True)
        try:
            base = _run_emit(other, args, args.base_set)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(other)], check=False)
    head = _run_emit(root, args, args.set)
    rows = compare(base, head, args.commuted)
    for r in rows:
        if r["verdict"] != "same":
            print(f"{r['module']:4d} {r['verdict']:9s} {r['head'] or r['base']}")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("same", "reordered", "differs", "missing")}
    print(f"ptx_same {args.family} against {args.base}: {len(rows)} modules; "
          + ", ".join(f"{n} {v}" for v, n in counts.items() if n))
    return int(counts["differs"] + counts["missing"] > 0)


if __name__ == "__main__":
    raise SystemExit(main())
