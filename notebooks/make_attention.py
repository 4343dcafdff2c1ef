"""Build and execute notebooks/attention.ipynb: decode attention results from results/<device>/attention.csv."""

from build import build, load_cell, plots_cell

CELLS = [
    ("md", """# Decode attention: what the device run measured

Computed from `results/<device>/attention.csv` (`lathe bench attention`). Bytes are K and V read
once plus q and the output; `pct_peak` is over the copy peak of the same process. Targets: flash
decode and paged v2 >= 75% of peak at ctx >= 8192 and >= 2x MLX sdpa there; lower latency than
sdpa at ctx <= 2048. The design and the causes are in `kernels/attention/NOTES.md`."""),
    load_cell("attention"),
    ("code", """dec = latest[latest.benchmark.str.startswith("attention-decode")]
us = dec.pivot_table(index=["variant", "batch", "ctx"], columns="kernel", values="us")
pct = dec.pivot_table(index=["variant", "batch", "ctx"], columns="kernel", values="pct_peak")
for k in ("flash_decode", "paged_v1", "paged_v2"):
    us[f"sdpa / {k}"] = us["mlx.sdpa"] / us[k]
display(pct.round(1))
us.round(2)"""),
    plots_cell("attention-*.png"),
]

if __name__ == "__main__":
    build("attention", CELLS)
