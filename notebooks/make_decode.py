"""Build and execute notebooks/decode.ipynb: the decode loop's results from results/<device>/decode.csv."""

from build import build, load_cell, plots_cell

CELLS = [
    ("md", """# The decode loop end to end: what the device runs measured

Computed from `results/<device>/decode.csv` (`lathe decode PRESET --variant ... --mode ...
--kv ...`, via `bash .ci/device decode`). Each row: greedy decode of 128 tokens after a 16-token
prompt (and `depth` tokens already in the cache), tok/s the mean of 3 runs. Variants: `reference`
(MLX built-ins), `unfused` and `fused` (lathe's kernels), `/paged` over vLLM's block pool. Targets
(issue 5): the best fused configuration >= 1.0x llama.cpp on the 7-8B Q4_0 models and above the
MLX built-in loop on every preset. Machines of the same kind differ by up to 1.4x on the same row,
so compare rows of one run. Where the time goes: `kernels/loop/NOTES.md`."""),
    load_cell("decode"),
    ("code", """import sys
sys.path.insert(0, str(root))
from harness.anchors import llama_cpp_tok_s

for sha in sorted(df.git_sha.unique(), key=lambda s: df[df.git_sha == s].date.max())[-2:]:
    run = df[df.git_sha == sha]
    table = run.pivot_table(index=["model", "qtype", "depth"], columns=["variant", "mode"],
                            values="decode_tok_s")
    print("run", sha)
    display(table.round(1))"""),
    ("code", """# The newest row of each (model, qtype, depth, variant, mode): a matrix may span device calls and
# commits (each row names its git_sha), while `latest` holds only the newest commit's rows.
newest = df.sort_values("date").groupby(["model", "qtype", "depth", "variant", "mode"]).tail(1)
rows = []
for (model, qtype, depth), g in newest.groupby(["model", "qtype", "depth"]):
    ref = g[g.variant == "reference"].decode_tok_s.max()
    ours = g[g.variant != "reference"].sort_values("decode_tok_s").iloc[-1]
    anchor = llama_cpp_tok_s(ours.device, model, qtype, int(depth))
    rows.append(dict(model=model, qtype=qtype, depth=depth, best=f"{ours.variant} {ours['mode']}",
                     tok_s=ours.decode_tok_s, vs_builtins=round(ours.decode_tok_s / ref, 2),
                     llama_cpp=anchor, vs_llama_cpp=round(ours.decode_tok_s / anchor, 2) if anchor else None,
                     pct_roofline=ours.pct_roofline, git_sha=ours.git_sha))
pd.DataFrame(rows)"""),
    plots_cell("decode.png"),
]

if __name__ == "__main__":
    build("decode", CELLS)
