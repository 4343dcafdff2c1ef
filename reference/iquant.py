"""GGUF's non-linear 4-bit formats IQ4_NL and IQ4_XS, from GGML's reference quantizer, in NumPy.

Each weight is a 4-bit index into GGML's table kvalues_iq4nl of 16 int8 levels, spaced closer near
zero (KVALUES below), times a scale. In each 32 weights, byte j holds weight j's index in its low
nibble and weight j + 16's in its high one (Q4_0's order). The layouts (ggml-common.h):
- IQ4_NL, 18 bytes a block of 32 weights: fp16 d, 16 bytes of indices; weight = d * kvalues[q].
- IQ4_XS, 136 bytes a super-block of 256 weights (K a multiple of 256): fp16 d, a little-endian
  uint16 scales_h, 4 bytes scales_l, 128 bytes of indices for 8 sub-blocks of 32. Sub-block i's
  6-bit scale ls is nibble i % 2 of scales_l[i / 2] (low nibble first) with bits 2i, 2i + 1 of
  scales_h above it; weight = d * (ls - 32) * kvalues[q], (d * (ls - 32)) rounded first.

The quantizer is GGML's quantize_row_iq4_nl_impl as its reference functions call it, with no
importance matrix (so each weight's weight in the fits is x^2), in float32 in GGML's order (sums
one element after another, nearest level by best_index_int8's comparisons):
- IQ4_NL (quantize_row_iq4_nl_ref, ntry = -1: no search): each block's indices come from the
  scale that maps its signed extreme to kvalues[0] = -127; d is then the least-squares scale for
  those indices. (llama-quantize's quantize_iq4_nl searches 15 more scales: not this function.)
- IQ4_XS (quantize_row_iq4_xs_ref = quantize_iq4_xs with no importance matrix, ntry = 7): each
  sub-block's least-squares scale, the best of 16 starting points (the extreme mapped to +127,
  then to -127 + t for t in -7..7); d = -(the sub-scale of largest magnitude) / 32, each ls =
  nearest(sub-scale / d) + 32 clamped to 0..63, and the indices chosen anew against d * (ls - 32).
A block (IQ4_NL) or sub-block whose largest |x| is under 1e-15 gets scale 0. GGML then leaves an
IQ4_NL block's index bytes as whatever its buffer held from the block before (undefined for a
first block); we write index 8 (level +1, nearest zero: what IQ4_XS writes under a zero scale),
0x88. Those are the only bytes that can differ from GGML's, and they decode to 0 either way.
"""

from __future__ import annotations

import numpy as np

from reference.quant import check_rows, quantizable

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
QK = 256
BLOCK_WEIGHTS = {"iq4_nl": 32, "iq4_xs": QK}
BLOCK_BYTES = {"iq4_nl": 2 + 16, "iq4_xs": 2 + 2 + 4 + 128}
QTYPES = tuple(BLOCK_BYTES)
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32
_LEVELS = KVALUES.astype(F32)
_ZERO_INDEX = 8  # best_index_int8(0): level +1 (0 - (-10) < 1 - 0 is false, the tie rule's upper)


def _check(qtype: str, k: int) -> None:
    check_rows(qtype, k, BLOCK_BYTES, BLOCK_WEIGHTS.get(qtype, 1))


def storage_bytes(qtype: str, n: int, k: int) -> int:
    """Bytes of an [n, k] matrix in `qtype`."""
    _check(qtype, k)
    return n * (k // BLOCK_WEIGHTS[qtype]) * BLOCK_BYTES[qtype]


def _best_index(x: np.ndarray) -> np.ndarray:
    """GGML's best_index_int8 for each element: its bisection ends with ml = how many of levels
    1..14 are not above x, then it takes level ml only when strictly nearer than ml + 1 (ties go
    up); at or past the ends this gives 0 or 15 as its early returns do. The levels are integers,
    so ml is a table's entry at floor(x) (a search per element cost 6x more); NaN, for which every
    `x < level` is false, counts all 14 (fmin takes 89 over NaN) and ends at 15, as in C."""
    at = np.fmax(np.fmin(np.floor(x), F32(_LOW_HIGH[1])), F32(_LOW_HIGH[0])).astype(np.int32)
    ml = _COUNT[at - _LOW_HIGH[0]]
    with np.errstate(invalid="ignore"):  # inf - inf at the ends: the comparison is false, as in C
        lower = x - _LEVELS[ml] < _LEVELS[ml + 1] - x
    return ml + 1 - lower.view(np.uint8)


_LOW_HIGH = (int(KVALUES[1]) - 1, int(KVALUES[14]))  # floor(x) past these counts 0 or 14 levels
_COUNT = (KVALUES[1:15, None] <= np.arange(_LOW_HIGH[0], _LOW_HIGH[1] + 1)).sum(axis=0).astype(np.uint8)


def _fit(xt: np.ndarray, wt: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The indices [..., 32, B], sumqx and sumq2 [..., B] of GGML's search for inverse scales `scale`
    [..., B] over the sub-blocks xt [32, B] (element-major: row i is element i of every sub-block,
    so that the sums, element after element as GGML's loop, read contiguous rows)."""
    indices = _best_index(scale[..., None, :] * xt)
    q = _LEVELS[indices]
    wq = wt * q
    qx, q2 = wq * xt, wq * q
    sumqx = np.zeros(q.shape[:-2] + q.shape[-1:], F32)
    sumq2 = sumqx.copy()
    for i in range(xt.shape[0]):
        sumqx = sumqx + qx[..., i, :]
        sumq2 = sumq2 + q2[..., i, :]
    return indices, sumqx, sumq2


def _sub_scales(x: np.ndarray, ntry: int) -> tuple[np.ndarray, np.ndarray]:
    """The first half of quantize_row_iq4_nl_impl for sub-blocks x [B, 32] (no importance matrix):
    (each one's float32 scale, 0 where its |x| stays under GROUP_MAX_EPS; the indices of the first
    fit, which IQ4_NL keeps)."""
    first = np.abs(x).argmax(axis=1)  # the first of equal magnitudes: GGML's strict >
    peak = x[np.arange(len(x)), first]
    empty = np.abs(peak) < GROUP_MAX_EPS
    peak = np.where(empty, F32(1), peak)  # any finite value: those sub-blocks' results are dropped
    xt = np.ascontiguousarray(x.T)
    wt = xt * xt
    d = ((-peak if ntry > 0 else peak) / _LEVELS[0]).astype(F32)
    indices, sumqx, sumq2 = _fit(xt, wt, (F32(1) / d).astype(F32))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(F32)
    best = d * sumqx
    if ntry > 0:  # all the tries' fits at once, then GGML's running best in its order
        tries = np.arange(-ntry, ntry + 1)
        inv = ((tries + int(KVALUES[0])).astype(F32)[:, None] / peak).astype(F32)
        for sumqx, sumq2 in zip(*_fit(xt, wt, inv)[1:]):
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            with np.errstate(divide="ignore", invalid="ignore"):
                d = np.where(better, sumqx / sumq2, d).astype(F32)
            best = np.where(better, d * sumqx, best)
    return np.where(empty, F32(0), d), np.where(empty[:, None], np.uint8(_ZERO_INDEX), indices.T)


def _pack_indices(indices: np.ndarray) -> np.ndarray:
    """[..., 32 m] indices -> [..., 16 m] bytes: in each 32, byte j = index j | index j + 16 << 4."""
    q = indices.reshape(*indices.shape[:-1], -1, 2, 16)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*indices.shape[:-1], -1)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    d, indices = _sub_scales(x, -1)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), _pack_indices(indices)], axis=1)


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    s = x.shape[0]
    sub = x.reshape(s * 8, 32)
    scales = _sub_scales(sub, 7)[0].reshape(s, 8)
    first = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(s), first]
    max_scale = np.where(max_scale == 0, F32(0), max_scale)  # GGML's running max starts at +0
    d = (-max_scale / F32(32)).astype(F32)  # all-zero super-block: d = -0, as GGML's
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    ls = np.clip(np.rint(inv[:, None] * scales), -32, 31).astype(np.int32)  # nearest_int: half to even
    dl = d[:, None] * ls.astype(F32)
    with np.errstate(divide="ignore"):
        idl = np.where(dl != 0, F32(1) / dl, F32(0)).astype(F32)
    with np.errstate(invalid="ignore"):  # inf * 0 where dl is subnormal: NaN, index 15 as GGML's
        indices = _best_index(idl[..., None] * x.reshape(s, 8, 32)).reshape(s, QK)
    ls = (ls + 32).astype(np.uint16)
    scales_l = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(s, 2), scales_h.view(np.uint8).reshape(s, 2),
                           scales_l, _pack_indices(indices)], axis=1)


_CHUNK = {"iq4_nl": 8192, "iq4_xs": 1024}  # blocks a pass: the searches' temporaries stay in cache


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """[n, k] floats -> [n, k / block weights * block bytes] uint8 blocks."""
    w = quantizable(w, qtype, BLOCK_BYTES, BLOCK_WEIGHTS.get(qtype, 1))
    n, k = w.shape
    x = w.reshape(-1, BLOCK_WEIGHTS[qtype])
    body, step = (_quantize_iq4_nl if qtype == "iq4_nl" else _quantize_iq4_xs), _CHUNK[qtype]
    with np.errstate(over="ignore"):  # a scale past fp16's range is inf, as GGML's conversion
        return np.concatenate([body(x[i:i + step]) for i in range(0, len(x), step)]).reshape(n, -1)


def dequantize(data: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """[n, k / block weights * block bytes] uint8 blocks -> [n, k] float32 (GGML's dequantize_row_*)."""
    _check(qtype, k)
    data = np.asarray(data, dtype=np.uint8)
    per_row = k // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]
    if data.ndim != 2 or data.shape[1] != per_row:
        raise ValueError(f"{qtype} data for rows of {k} must be [n, {per_row}] bytes, got {data.shape}")
    b = data.reshape(-1, BLOCK_BYTES[qtype])
    d = np.ascontiguousarray(b[:, :2]).view(np.float16).astype(F32)  # [blocks, 1]
    qs = b[:, -BLOCK_WEIGHTS[qtype] // 2:].reshape(len(b), -1, 16)
    levels = _LEVELS[np.concatenate([qs & 0xF, qs >> 4], axis=-1)]  # [blocks, sub-blocks, 32]
    if qtype == "iq4_nl":
        return (d[:, :, None] * levels).reshape(data.shape[0], k)
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.int32)  # [blocks, 1]
    scales_l = b[:, 4:8].astype(np.int32)
    sub = np.arange(8)
    ls = ((scales_l[:, sub // 2] >> (4 * (sub % 2))) & 0xF) | (((scales_h >> (2 * sub)) & 3) << 4)
    dl = d * (ls - 32).astype(F32)  # GGML's dl = d * (ls - 32), then dl * level
    return (dl[:, :, None] * levels).reshape(data.shape[0], k)


# ---- the v3 GEMV's load-time layout (kernels.gemv.repack): the K-quants' regions ----------------
# An IQ4_NL or IQ4_XS matrix [n, k] repacked is its chunks of 32 weights (an IQ4_NL block, an
# IQ4_XS sub-block), row after row, in two regions, as many bytes as the GGUF blocks: every chunk's
# 16 bytes of nibbles as GGUF has them (byte l: weight l low, l + 16 high; Q4_0's order), then
# IQ4_NL's fp16 d a block, or IQ4_XS's 8-byte head a super-block (d, scales_h, scales_l).
def _head_bytes(qtype: str) -> int:
    return BLOCK_BYTES[qtype] - BLOCK_WEIGHTS[qtype] // 2


def pack(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """GGUF blocks [n, k / block weights * block bytes] -> the repacked bytes (the layout above)."""
    _check(qtype, k)
    blocks = np.asarray(data, dtype=np.uint8).reshape(n * (k // BLOCK_WEIGHTS[qtype]), BLOCK_BYTES[qtype])
    head = _head_bytes(qtype)
    return np.concatenate([blocks[:, head:].reshape(-1), blocks[:, :head].reshape(-1)])


def dequantize_packed(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The repacked bytes -> [n, k] float32, read from the layout's definition (not by undoing
    pack): the values dequantize gives for the blocks they came from."""
    _check(qtype, k)
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    chunks, blocks = n * k // 32, n * k // BLOCK_WEIGHTS[qtype]
    if data.size != blocks * BLOCK_BYTES[qtype]:
        raise ValueError(f"packed {qtype} [{n}, {k}] takes {blocks * BLOCK_BYTES[qtype]} bytes, got {data.size}")
    qs = data[: 16 * chunks].reshape(chunks, 16)
    levels = _LEVELS[np.concatenate([qs & 0xF, qs >> 4], axis=-1)]  # [chunks, 32]
    heads = data[16 * chunks:].reshape(blocks, _head_bytes(qtype))
    d = np.ascontiguousarray(heads[:, :2]).view(np.float16).astype(F32)  # [blocks, 1]
    if qtype == "iq4_nl":
        return (d * levels).reshape(n, k)
    scales_h = np.ascontiguousarray(heads[:, 2:4]).view("<u2").astype(np.int32)
    sub = np.arange(8)
    ls = ((heads[:, 4:8].astype(np.int32)[:, sub // 2] >> (4 * (sub % 2))) & 0xF) | (((scales_h >> (2 * sub)) & 3) << 4)
    dl = (d * (ls - 32).astype(F32)).reshape(chunks, 1)  # GGML's dl, then dl * level
    return (dl * levels).reshape(n, k)
