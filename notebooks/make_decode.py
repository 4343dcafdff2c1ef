"""Build and execute notebooks/decode.ipynb: the decode loop's results from results/<device>/decode.csv."""

from build import build, load_cell, plots_cell

CELLS = [
    ("md", """# The decode loop end to end: what the device runs measured

Computed from `results/<device>/decode.csv` (`lathe decode PRESET --variant ... --mode ...
--kv ... --depth ...`, via `bash .ci/device decode` and `bash .ci/device peers`). Each row:
greedy decode of 128 tokens after a 16-token prompt (and `depth` tokens already in the cache),
tok/s the mean of 3 runs. Variants: `reference` (MLX built-ins), `unfused` and `fused` (lathe's
kernels), `/paged` over vLLM's block pool, and `llama.cpp`: llama.cpp's `llama-bench` on the same
file, timed by the workbench in the same run (`--peer llama.cpp`), taking turns with lathe's rows
round by round. Ratios to llama.cpp come only from rows of one run (machines of one kind differ
by up to 1.4x); where a run has no llama.cpp row, ANCHORS.md's figure stands in, labelled as
another run's. Where the time goes: `kernels/loop/NOTES.md`."""),
    load_cell("decode"),
    ("code", """for sha in sorted(df.git_sha.unique(), key=lambda s: df[df.git_sha == s].date.max())[-2:]:
    run = df[df.git_sha == sha]
    table = run.pivot_table(index=["model", "qtype", "depth"], columns=["variant", "mode"],
                            values="decode_tok_s")
    print("commit", sha, "(rounds averaged)")
    display(table.round(1))"""),
    ("md", """## lathe against llama.cpp, run by run

Each run with llama.cpp rows (one `lathe decode --peer llama.cpp` command): lathe's best row and
llama.cpp's in each round, and `x_llama_cpp` as the CSV holds it (lathe's tok/s over the same
round's llama.cpp row). The spread between rounds is the drift between the two while they took
turns."""),
    ("code", """peer = df[df.variant == "llama.cpp"]
rows = []
for (date, model, qtype, depth), theirs in peer.groupby(["date", "model", "qtype", "depth"]):
    run = df[(df.date == date) & (df.model == model) & (df.qtype == qtype) & (df.depth == depth)]
    ours = run[run.variant != "llama.cpp"]
    best = ours.groupby(["variant", "mode"]).decode_tok_s.mean().idxmax()
    ours = ours[(ours.variant == best[0]) & (ours["mode"] == best[1])]
    rows.append(dict(model=model, qtype=qtype, depth=depth, run=f"{run.git_sha.iloc[0]} {date[:16]}",
                     lathe=f"{best[0]} {best[1]}", lathe_tok_s=" / ".join(f"{t:.1f}" for t in ours.decode_tok_s),
                     llama_cpp_tok_s=" / ".join(f"{t:.1f}" for t in theirs.decode_tok_s),
                     x_llama_cpp=" / ".join(f"{x:.2f}" for x in ours.x_llama_cpp),
                     x_mean=round(ours.x_llama_cpp.mean(), 3),
                     llama_cpp_pp=" / ".join(f"{t:.0f}" for t in theirs.prefill_tok_s),
                     lathe_pp=" / ".join(f"{t:.0f}" for t in ours.prefill_tok_s),
                     llama_cpp_build=theirs.peer_build.iloc[0]))
pd.DataFrame(rows)"""),
    ("md", """## Configurations without a llama.cpp row in their newest run

The newest run of each (model, qtype, depth) that has no llama.cpp row: lathe's best, and the
ratio to ANCHORS.md's figure (`harness/anchors.py`, another day and machine: a fallback only)."""),
    ("code", """import sys
sys.path.insert(0, str(root))
from harness.anchors import llama_cpp_tok_s

rows = []
for (model, qtype, depth), g in df.groupby(["model", "qtype", "depth"]):
    newest = g[g.date == g.date.max()]
    if (newest.variant == "llama.cpp").any():
        continue
    ours = newest.sort_values("decode_tok_s").iloc[-1]
    anchor = llama_cpp_tok_s(ours.device, model, qtype, int(depth))
    rows.append(dict(model=model, qtype=qtype, depth=depth, best=f"{ours.variant} {ours['mode']}",
                     tok_s=ours.decode_tok_s, run=f"{ours.git_sha} {ours.date[:16]}",
                     anchors_md_tok_s=anchor, x_anchors_md=round(ours.decode_tok_s / anchor, 2) if anchor else None,
                     pct_roofline=ours.pct_roofline))
pd.DataFrame(rows)"""),
    plots_cell("decode.png"),
]

if __name__ == "__main__":
    build("decode", CELLS)
