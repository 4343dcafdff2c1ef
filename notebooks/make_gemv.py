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
latest = bench[bench.git_sha == bench.sort_values("date").git_sha.iloc[-1]]"""),
    ("md", """## The GEMV targets: % of peak by GPU time, wall over GPU time, M rows

`harness.tools.gemv_report` reads the run: the GEMVs the decode loop runs (v3 on weights repacked at
load, the fused v3 forms) and MLX's peers at M = 1, by GPU time (`gpu_us`, CUPTI) as % of the
copy peak of the same process, against the target floor for the shape (>= 85% large, >= 75%
4096x4096 and QKV, >= 50% Qwen3-0.6B); wall over GPU time (<= 1.15 from 14336x4096 up); and
M = 2..4 over M = 1 (<= 1.3 at the large shapes). GPU time can read above 100% where a round's
calls overlap (kernels/gemv/NOTES.md, "Measurement notes")."""),
    ("code", """import sys
sys.path.insert(0, str(root))
from harness.tools.gemv_report import m1_table, m_table

print("benchmark run:", latest.git_sha.iloc[0], "on", latest.device.iloc[0])
m1_table(latest)"""),
    ("code", """m_table(latest)"""),
    ("md", """## Fused against unfused (M = 1)"""),
    ("code", """f = latest[latest.benchmark == "gemv-fused"].pivot_table(index=["kernel", "N", "K"], columns="variant", values="us")
f["unfused / fused"] = (f.unfused / f.fused).round(2)
f"""),
    ("md", """## M rows: GEMV launches of 4 rows against dequantize + MLX matmul (Q4_0 4096x4096)"""),
    ("code", """b = latest[(latest.benchmark == "gemv-batched") & (latest.kernel == "linear_q4_0")
           & (latest.N.astype(str) == "4096") & (latest.K.astype(str) == "4096")]
b = b.pivot_table(index="M", columns="variant", values="us")
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
