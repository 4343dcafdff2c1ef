"""Build and execute notebooks/rope.ipynb: the RoPE results read from results/<device>/rope.csv.

    python notebooks/make_rope.py      (needs nbformat, nbclient and ipykernel)
"""

from build import build

CELLS = [
    ("md", """# RoPE family: what the device run measured

Everything below is computed from `results/<device>/rope.csv` and `peak.csv`, written by
`lathe bench rope` (and `lathe bench rope --sweep`) on the device. Times are per call inside one
`mx.eval` of K calls over inputs rotated through more than 4x the L2 cache; `host_us` is the
Python graph building per call, timed apart. GB/s is the operation's minimum bytes (Q, K, V read
once; rotated Q, K rows and V rows written once) over the time, so every path of one shape is
charged the same bytes."""),
    ("code", """import pandas as pd
from pathlib import Path

root = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
device_dir = sorted(p for p in (root / "results").iterdir() if p.is_dir())[0]
df = pd.read_csv(device_dir / "rope.csv", dtype={"git_sha": str})
latest = df[df.date == df.date.max()]  # the newest full run
peak = pd.read_csv(device_dir / "peak.csv")
print(device_dir.name, "| runs:", sorted(df.git_sha.unique()), "| newest:", latest.git_sha.iloc[0])
peak[["kernel", "gbs", "date"]]"""),
    ("md", """## Decode (one token): fused against the sequences it replaces

Target: each fused kernel at least 2x faster than the unfused sequence it replaces, and faster
than the MLX built-in path. Ratios are unfused (or MLX) time over fused time, form against form."""),
    ("code", """dec = latest[latest.benchmark.str.contains("decode")].set_index(["benchmark", "kernel", "variant"]).us
rows = []
for bench in sorted({b for b, _, _ in dec.index}):
    fused = [k for b, k, v in dec.index if b == bench and k not in ("unfused", "mlx.fast.rope")][0]
    for form in ("in_place", "functional"):
        rows.append(dict(model=bench.removeprefix("rope-decode-"), kernel=fused, form=form,
                         fused_us=dec[bench, fused, form], unfused_us=dec[bench, "unfused", form],
                         mlx_us=dec[bench, "mlx.fast.rope", "peer"]))
t = pd.DataFrame(rows)
t["vs_unfused"] = (t.unfused_us / t.fused_us).round(2)
t["vs_mlx"] = (t.mlx_us / t.fused_us).round(2)
t"""),
    ("md", """## Prefill: bandwidth against the measured peak

Target: the batch variants at or above 70% of the measured peak at seq >= 2048."""),
    ("code", """pre = latest[latest.benchmark.str.contains("prefill|q-only")]
table = pre.pivot_table(index=["benchmark", "kernel", "variant"], columns="seq", values="pct_peak")
table.round(1)"""),
    ("md", """## Launch knobs (`lathe bench rope --sweep`)

Heads per thread (a compile-time constant) and threads per threadgroup, at the sizes that
matter; `rel_err` compares each launch's output with the default launch's (0: bit-identical)."""),
    ("code", """sweep = df[df.benchmark.str.contains("sweep")]
sweep.pivot_table(index=["benchmark", "kernel", "seq"], columns="variant", values="pct_peak").round(1)"""),
    ("code", """print("worst rel_err in the sweep:", sweep.rel_err.max())"""),
    ("md", """## Plots

`rope-prefill-*.png` and `rope-q-only-*.png` (GB/s against tokens, peak dashed) and
`rope-decode.png` (us per call, ratios to the unfused in-place sequence) sit next to the CSV."""),
    ("code", """from IPython.display import Image, display
for png in sorted(device_dir.glob("rope-*.png")):
    print(png.name)
    display(Image(filename=str(png), width=640))"""),
]


if __name__ == "__main__":
    build("rope", CELLS)
