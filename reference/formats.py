"""Every GGUF block type lathe reads, by its GGUF name ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0":
reference.quant; "Q4_K", "Q5_K", "Q6_K": reference.kquant; "IQ4_NL", "IQ4_XS": reference.iquant):
one dispatch for the model loader, writer and reference forward."""

from __future__ import annotations

import numpy as np

from reference import iquant, kquant, quant

GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def _format(kind: str):
    if kind not in GGUF_BLOCK_TYPES:
        raise ValueError(f"block type must be one of {GGUF_BLOCK_TYPES}, got {kind!r}")
    return kquant if kind.endswith("_K") else iquant if kind.startswith("IQ") else quant


def block_weights(kind: str) -> int:
    """Weights a block of `kind` holds (32, or 256 for a K-quant or IQ4_XS super-block)."""
    fmt = _format(kind)
    return kquant.QK_K if fmt is kquant else iquant.BLOCK_WEIGHTS[kind.lower()] if fmt is iquant else quant.BLOCK


def row_bytes(kind: str, k: int) -> int:
    """Bytes of a row of k weights in `kind`."""
    return _format(kind).storage_bytes(kind.lower(), 1, k)


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """[n, k] floats as blocks of `kind`."""
    return _format(kind).quantize(w, kind.lower())


def dequantize(data: np.ndarray, kind: str, k: int) -> np.ndarray:
    """Blocks of `kind` -> [n, k] float32."""
    return _format(kind).dequantize(data, kind.lower(), k)
