"""Build and execute notebooks/gemv.ipynb: the quantized GEMV results from results/<device>/gemv.csv."""

from build import build, load_cell, plots_cell

CELLS = [
    ("md", """# Quantized GEMV (Q4_0, Q8_0): what the device run measured

Computed from `results/<device>/gemv.csv`, written by `lathe bench gemv` (and `--sweep`) on the
device. Bytes are the quantized weights (scales included) + X + Y; `pct_peak` is GB/s over the
16-byte copy peak measured in the same process. The design and the causes of what is not
reached are in `kernels/gemv/NOTES.md`."""),
    load_cell("gemv"),
    ("code", """# The sweep runs apart: `latest` is the newest run of the benchmark proper.
bench = df[df.benchmark != "gemv-sweep"]
latest = bench[bench.git_sha == bench.sort_values("date").git_sha.iloc[-1]]
print("benchmark run:", latest.git_sha.iloc[0])"""),
    ("md", """## M = 1: % of peak, and v2's speed against the peers

Targets: v2 >= 80% of peak at 14336x4096, 4096x14336 and 128256x4096, >= 60% at 4096x4096,
and >= 3x `mx.quantized_matmul` 4-bit on each shape."""),
    ("code", """m1 = latest[latest.benchmark == "gemv-m1"]
pct = m1.pivot_table(index=["N", "K"], columns=["kernel", "variant"], values="pct_peak", sort=False)
us = m1.pivot_table(index=["N", "K"], columns=["kernel", "variant"], values="us", sort=False)
ratios = pd.DataFrame({
    "Q4_0 v2 vs MLX 4-bit": us["mlx.quantized_matmul", "4bit-gs32"] / us["gemv_q4_0", "v2"],
    "Q8_0 v2 vs MLX 8-bit": us["mlx.quantized_matmul", "8bit-gs32"] / us["gemv_q8_0", "v2"],
    "Q4_0 v2 vs v1": us["gemv_q4_0", "v1"] / us["gemv_q4_0", "v2"],
})
display(pct.round(1))
ratios.round(2)"""),
    ("md", """## Fused against unfused (M = 1)"""),
    ("code", """f = latest[latest.benchmark == "gemv-fused"].pivot_table(index=["kernel", "N", "K"], columns="variant", values="us")
f["unfused / fused"] = (f.unfused / f.fused).round(2)
f"""),
    ("md", """## M rows: GEMV launches of 4 rows against dequantize + MLX matmul (Q4_0 4096x4096)"""),
    ("code", """b = latest[latest.benchmark == "gemv-batched"].pivot_table(index="M", columns="variant", values="us")
b"""),
    ("md", """## Launch knobs (`lathe bench gemv --sweep`, its newest run)"""),
    ("code", """sw = df[df.benchmark == "gemv-sweep"]
if sw.empty:
    print("no sweep rows in the CSV (the sweep logs are in results/<device>/logs/)")
else:
    sw = sw[sw.git_sha == sw.sort_values("date").git_sha.iloc[-1]]
    print("sweep run:", sw.git_sha.iloc[0], "(% of peak by round time; GPU busy us a call where traced)")
    display(sw.pivot_table(index=["kernel", "N", "K"], columns="variant", values="pct_peak").round(1))
    if sw.gpu_us.notna().any():
        display(sw.pivot_table(index=["kernel", "N", "K"], columns="variant", values="gpu_us").round(2))"""),
    plots_cell("gemv-*.png"),
]

if __name__ == "__main__":
    build("gemv", CELLS)
