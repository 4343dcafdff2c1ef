"""Build and execute notebooks/attention.ipynb: decode attention results from results/<device>/attention.csv."""

from build import build, load_cell, plots_cell

CELLS = [
    ("md", """# Decode and prefill attention: what the device run measured

Computed from `results/<device>/attention.csv` (`lathe bench attention`). Bytes are K and V read
once plus q and the output; percentages are over the copy peak measured in the same process.
Each row has the wall time a call (`us`: what a caller waits) and the GPU time a call (`gpu_us`,
CUPTI), and `gpu_kernels` splits the GPU time by kernel (the split attention and its combine;
MLX's sdpa and its reduction). The design, the profiles and the causes of what is not reached
are in `kernels/attention/NOTES.md`."""),
    load_cell("attention"),
    ("md", """## The attention targets

`harness.tools.attention_report` reads the newest run, from the rows run with the default options (an
A/B pass's `--set` rows are left out): batch 1 (and the chained rows, where each call waits for
the one before), the best of flash decode and paged v2 >= 90% of peak by GPU time at 8192 and
32768 tokens for every head shape and by wall time ahead of MLX's sdpa at every context; mixed
batches of 8 and 32 >= 90% at 32768; the tiled prefill >= 0.8x MLX's causal sdpa from 512
tokens."""),
    ("code", """import sys
sys.path.insert(0, str(root))
from harness.tools.attention_report import decode_table, mixed_table, prefill_table

print("benchmark run:", latest.git_sha.iloc[0], "on", latest.device.iloc[0])
decode_table(latest)"""),
    ("code", """mixed_table(latest)"""),
    ("code", """prefill_table(latest)"""),
    ("md", """## Experiment rows of the same run

Rows run with an option set (`options`), beside the defaults' rows of the same cases: GPU time a
call."""),
    ("code", """ab = latest[latest.options.fillna("") != ""]
if ab.empty:
    print("no rows with options in this run")
else:
    cases = ab[["benchmark", "kernel", "variant", "ctx"]].drop_duplicates()
    rows = latest.merge(cases, on=["benchmark", "kernel", "variant", "ctx"])
    display(rows.assign(options=rows.options.fillna("defaults"))
            .pivot_table(index=["benchmark", "variant", "kernel", "ctx"], columns="options", values="gpu_us", aggfunc="last").round(2))"""),
    plots_cell("attention-*.png"),
]

if __name__ == "__main__":
    build("attention", CELLS)
