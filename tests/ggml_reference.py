"""GGML's own reference quantizers (quantize_row_*_ref in ggml-quants.c), built from llama.cpp's
sources into a small shared library, so that tests compare our NumPy quantizers with them byte for
byte (the `gguf` package quantizes Q4_0 and Q8_0 but not the K-quants).

The sources are the llama.cpp that the peers step builds (llama-cpp-python 0.3.36 = llama.cpp
0c1e57098): $LATHE_GGML_SRC (a llama.cpp checkout), else the staged .device/llama/src.tgz, else
the sdist downloaded from the package registry. They are compiled with the system C compiler with
floating-point contraction off, so that every product and sum is rounded to float32 as GGML's C
reads (x86-64's baseline has no FMA anyway; aarch64 would contract by default). The library is
kept under ~/.cache/lathe/ggml-ref. Where any step fails the caller skips, saying why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lathe" / "ggml-ref"

# ggml-quants.c calls these only outside the reference quantizers; they stop the process if reached
_SHIM = """
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) { abort(); }
size_t ggml_row_size(int type, long long ne) { abort(); }
const char * ggml_type_name(int type) { abort(); }
size_t ggml_type_size(int type) { abort(); }
"""


def _sources(work: Path) -> Path:
    """A directory holding llama.cpp's ggml/ (ggml/src/ggml-quants.c)."""
    given = os.environ.get("LATHE_GGML_SRC")
    if given:
        return Path(given)
    staged = ROOT / ".device" / "llama" / "src.tgz"
    if staged.exists():
        _unpack(staged, work, "llama.cpp/ggml/")
        return work / "llama.cpp"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(work)], check=True, capture_output=True, timeout=600)
    _unpack(work / f"llama_cpp_python-{VERSION}.tar.gz", work, "/vendor/llama.cpp/ggml/")
    return work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def _unpack(archive: Path, into: Path, part: str) -> None:
    """The members of a .tar.gz whose names hold `part`, plain files and directories only."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if part in m.name and (m.isfile() or m.isdir())
                   and not m.name.startswith("/") and ".." not in m.name.split("/")]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(into, members=members, **safe)


@functools.cache
def library() -> ctypes.CDLL:
    """The built library (raises where the sources or a C compiler cannot be had)."""
    lib = CACHE / f"ggml-quants-{VERSION}.so"
    if not lib.exists():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler")
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = _sources(Path(tmp)) / "ggml"
            shim = Path(tmp) / "shim.c"
            shim.write_text(_SHIM)
            part = lib.with_suffix(f".{os.getpid()}.part")
            subprocess.run([cc, "-O2", "-std=gnu11", "-ffp-contract=off", "-fPIC", "-shared",
                            f"-I{src / 'src'}", f"-I{src / 'include'}", str(src / "src" / "ggml-quants.c"),
                            str(shim), "-o", str(part), "-lm"], check=True, capture_output=True, timeout=300)
            os.replace(part, lib)
    return ctypes.CDLL(str(lib))


def quantize(w: np.ndarray, qtype: str, row_bytes: int) -> np.ndarray:
    """[n, k] float32 through GGML's quantize_row_<qtype>_ref -> [n, row_bytes] bytes."""
    fn = getattr(library(), f"quantize_row_{qtype.replace('_k', '_K')}_ref")
    x = np.ascontiguousarray(w, dtype=np.float32)
    out = np.zeros((x.shape[0], row_bytes), np.uint8)
    fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return out
