"""GGUF block formats Q4_0 and Q8_0, from GGML's reference quantizer, in NumPy.

A row of K weights (K a multiple of 32) is stored as K / 32 blocks, each an fp16 scale d followed
by the quantized values:
- Q4_0, 18 bytes a block: d = (the element of largest magnitude, with its sign) / -8; value i is
  q_i = min(15, trunc(x_i / d + 8.5)) in 4 bits; byte j holds q_j in its low nibble and q_{j+16}
  in its high nibble; weight = (q - 8) * d.
- Q8_0, 34 bytes a block: d = max |x| / 127; q_i = round(x_i / d) (half away from zero) as int8;
  weight = q * d.
The arithmetic is float32 as in GGML (1/d computed once, then multiplied), so that the bytes are
those of GGML and of the `gguf` package; a block of zeros has d = 0 and all q at their zero point.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
BLOCK_BYTES = {"q4_0": 2 + BLOCK // 2, "q8_0": 2 + BLOCK}
QTYPES = tuple(BLOCK_BYTES)


def check_rows(qtype: str, k: int, block_bytes: dict[str, int], block: int) -> None:
    """A clear error unless `qtype` is one of block_bytes' and rows of k hold whole blocks of
    `block` weights (this module's formats, and reference.kquant's super-blocks)."""
    if qtype not in block_bytes:
        raise ValueError(f"qtype must be one of {tuple(block_bytes)}, got {qtype!r}")
    if k % block:
        raise ValueError(f"{qtype} rows hold blocks of {block} weights: the row length K must be a multiple of "
                         f"{block}, got {k}")


def _check(qtype: str, k: int) -> None:
    check_rows(qtype, k, BLOCK_BYTES, BLOCK)


def storage_bytes(qtype: str, n: int, k: int) -> int:
    """Bytes of an [n, k] matrix in `qtype`."""
    _check(qtype, k)
    return n * (k // BLOCK) * BLOCK_BYTES[qtype]


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """[n, k] floats -> [n, k / 32 * block bytes] uint8 blocks."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"w must be [n, k], got shape {w.shape}")
    n, k = w.shape
    _check(qtype, k)
    if not np.all(np.isfinite(w)):
        raise ValueError("w has NaN or inf: GGUF blocks cannot hold them")
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    if qtype == "q4_0":
        where = np.abs(blocks).argmax(axis=-1)[..., None]  # first of equal magnitudes, as GGML
        d = (np.take_along_axis(blocks, where, axis=-1) / np.float32(-8)).astype(np.float32)
        q = np.trunc(blocks * _inverse(d) + np.float32(8.5)).astype(np.int32)
        q = np.minimum(q, 15).astype(np.uint8)
        body = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    else:
        d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
        body = _round_half_away(blocks * _inverse(d)).astype(np.int8).view(np.uint8)
    scale = d.astype(np.float16).view(np.uint8)  # [n, blocks, 2]
    return np.concatenate([scale, body], axis=-1).reshape(n, -1)


def dequantize(data: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """[n, k / 32 * block bytes] uint8 blocks -> [n, k] float32."""
    _check(qtype, k)
    data = np.asarray(data, dtype=np.uint8)
    n_blocks = k // BLOCK
    if data.ndim != 2 or data.shape[1] != n_blocks * BLOCK_BYTES[qtype]:
        raise ValueError(
            f"{qtype} data for rows of {k} must be [n, {n_blocks * BLOCK_BYTES[qtype]}] bytes, "
            f"got {data.shape}"
        )
    blocks = data.reshape(data.shape[0], n_blocks, BLOCK_BYTES[qtype])
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)
    body = blocks[..., 2:]
    if qtype == "q4_0":
        q = np.concatenate([body & 0x0F, body >> 4], axis=-1).astype(np.float32) - 8
    else:
        q = np.ascontiguousarray(body).view(np.int8).astype(np.float32)
    return (q * d).reshape(data.shape[0], k)


def dequantize_packed(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The v3 GEMV's load-time layout (kernels.gemv.repack) -> [n, k] float32, read from its
    definition: all the blocks' quants first, row after row and block after block (each in its
    GGUF order: 16 bytes for Q4_0, 32 for Q8_0), then all the fp16 scales in the same order."""
    _check(qtype, k)
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    n_blocks = k // BLOCK
    quant_bytes = BLOCK_BYTES[qtype] - 2
    if data.size != n * n_blocks * BLOCK_BYTES[qtype]:
        raise ValueError(f"packed {qtype} [{n}, {k}] takes {n * n_blocks * BLOCK_BYTES[qtype]} bytes, got {data.size}")
    body = data[: n * n_blocks * quant_bytes].reshape(n, n_blocks, quant_bytes)
    d = data[n * n_blocks * quant_bytes:].view(np.float16).astype(np.float32).reshape(n, n_blocks, 1)
    if qtype == "q4_0":
        q = np.concatenate([body & 0x0F, body >> 4], axis=-1).astype(np.float32) - 8
    else:
        q = body.view(np.int8).astype(np.float32)
    return (q * d).reshape(n, k)


def gguf_rows(data: np.ndarray, ne: tuple[int, ...]) -> np.ndarray:
    """A GGUF 2-D tensor as the [N, K] row-major matrix the kernels use.

    GGUF lists dimensions fastest first: ne = (K, N) for N rows of K weights (a linear layer
    with K inputs and N outputs), stored row after row. Float tensors come back as [N, K]
    values; quantized ones as [N, K / 32 * block bytes] bytes.
    """
    if len(ne) != 2:
        raise ValueError(f"expected a 2-D tensor, got ne={ne}")
    k, n = ne
    flat = np.asarray(data).reshape(-1)
    if flat.dtype == np.uint8:
        return flat.reshape(n, -1)
    return flat.reshape(n, k)

