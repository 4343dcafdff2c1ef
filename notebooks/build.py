"""Shared by the notebook builders (make_<family>.py): the cell that loads a family's CSV, and
building + executing a notebook from a list of cells ("md" or "code", source).

    python notebooks/make_<family>.py      (needs nbformat, nbclient and ipykernel)
"""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def load_cell(family: str) -> tuple[str, str]:
    """A code cell: `df` (the family's CSV), `latest` (its newest run), `peak` (peak.csv, where the
    device has one), `device_dir` (the device with the newest run of the family)."""
    return ("code", f"""import pandas as pd
from pathlib import Path

root = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
# The device whose {family}.csv holds the newest run (results/ has one folder per device)
newest = lambda d: pd.read_csv(d / "{family}.csv", usecols=["date"]).date.max()
device_dir = max((d for d in (root / "results").iterdir() if (d / "{family}.csv").exists()), key=newest)
df = pd.read_csv(device_dir / "{family}.csv", dtype={{"git_sha": str}})
latest = df[df.git_sha == df.sort_values("date").git_sha.iloc[-1]]  # the newest run's code
# the peak each row was measured against is in its own peak_gbs; peak.csv lists the session's runs
peak = pd.read_csv(device_dir / "peak.csv") if (device_dir / "peak.csv").exists() else None
print(device_dir.name, "| runs:", sorted(df.git_sha.unique()), "| newest:", latest.git_sha.iloc[0])""")


def plots_cell(pattern: str) -> tuple[str, str]:
    return ("code", f"""from IPython.display import Image, display
for png in sorted(device_dir.glob("{pattern}")):
    print(png.name)
    display(Image(filename=str(png), width=640))""")


def build(name: str, cells: list[tuple[str, str]]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    out = HERE / f"{name}.ipynb"
    nbformat.write(nb, out)
    return out
