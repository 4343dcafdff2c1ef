"""GGUF's 32-weight block formats Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, from GGML's reference quantizer,
in NumPy.

A row of K weights (K a multiple of 32) is stored as K / 32 blocks, each an fp16 scale d (and for
Q4_1/Q5_1 an fp16 min m) followed by the quantized values (ggml-common.h's block_q*):
- Q4_0, 18 bytes a block: d = (the element of largest magnitude, with its sign) / -8; value i is
  q_i = min(15, trunc(x_i / d + 8.5)) in 4 bits; byte j holds q_j in its low nibble and q_{j+16}
  in its high nibble; weight = (q - 8) * d.
- Q4_1, 20 bytes: d, then m = min x, then Q4_0's nibbles of q_i = min(15, trunc((x_i - m) / d + 0.5))
  with d = (max x - min x) / 15; weight = q * d + m.
- Q5_0, 22 bytes: d = (signed extreme) / -16, then 4 bytes qh (a little-endian uint32 whose bit i
  is bit 4 of q_i), then the low 4 bits of each q_i = min(31, trunc(x_i / d + 16.5)) as Q4_0's
  nibbles; weight = (q - 16) * d.
- Q5_1, 24 bytes: d = (max - min) / 31, m = min, qh, nibbles of q_i = trunc((x_i - m) / d + 0.5)
  (GGML clamps nothing here: q never passes 31); weight = q * d + m.
- Q8_0, 34 bytes a block: d = max |x| / 127; q_i = round(x_i / d) (half away from zero) as int8;
  weight = q * d.
The arithmetic is float32 as in GGML (1/d computed once, then multiplied), so that the bytes are
those of GGML and of the `gguf` package; a block of zeros has d = 0 and all q at their zero point.
Where the two differ, on blocks of zeros led by a -0, Q5_0 writes GGML's d = -0 (its running
maximum starts at +0) and Q4_0 keeps gguf's +0 (tests/test_quant_reference.py compares it with
gguf).
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
# the 4- and 5-bit formats: (bits a quant, whether the block has a min m after d)
NIBBLE_TYPES = {"q4_0": (4, False), "q4_1": (4, True), "q5_0": (5, False), "q5_1": (5, True)}
BLOCK_BYTES = {**{q: 2 + 2 * has_min + 4 * (bits == 5) + BLOCK // 2 for q, (bits, has_min) in NIBBLE_TYPES.items()},
               "q8_0": 2 + BLOCK}
QTYPES = tuple(BLOCK_BYTES)
PACKED_QTYPES = ("q4_0", "q8_0")  # those the v3 GEMV repacks (dequantize_packed)


def check_rows(qtype: str, k: int, block_bytes: dict[str, int], block: int) -> None:
    """A clear error unless `qtype` is one of block_bytes' and rows of k hold whole blocks of
    `block` weights (this module's formats, and reference.kquant's super-blocks)."""
    if qtype not in block_bytes:
        raise ValueError(f"qtype must be one of {tuple(block_bytes)}, got {qtype!r}")
    if k % block:
        raise ValueError(f"{qtype} rows hold blocks of {block} weights: the row length K must be a multiple of "
                         f"{block}, got {k}")


def quantizable(w: np.ndarray, qtype: str, block_bytes: dict[str, int], block: int) -> np.ndarray:
    """w as float32 [n, k], checked for quantizing into `qtype` (this module's formats and
    reference.kquant's, reference.iquant's): a 2-D array of finite values in whole blocks."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"w must be [n, k], got shape {w.shape}")
    check_rows(qtype, w.shape[1], block_bytes, block)
    if not np.all(np.isfinite(w)):
        raise ValueError("w has NaN or inf: GGUF blocks cannot hold them")
    return w.astype(np.float32)


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
    w = quantizable(w, qtype, BLOCK_BYTES, BLOCK)
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    if qtype == "q8_0":
        d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
        body = _round_half_away(blocks * _inverse(d)).astype(np.int8).view(np.uint8)
        head = [d]
    else:
        bits, has_min = NIBBLE_TYPES[qtype]
        top = (1 << bits) - 1
        if has_min:  # GGML's strict < and > loops keep the first of equal values (-0 or +0)
            lo = np.take_along_axis(blocks, blocks.argmin(axis=-1)[..., None], axis=-1)
            hi = np.take_along_axis(blocks, blocks.argmax(axis=-1)[..., None], axis=-1)
            d = ((hi - lo) / np.float32(top)).astype(np.float32)
            with np.errstate(invalid="ignore"):  # only a range past float32's (x - lo = inf, times 0)
                q = np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5))
            head = [d, lo]
        else:
            where = np.abs(blocks).argmax(axis=-1)[..., None]  # first of equal magnitudes, as GGML
            peak = np.take_along_axis(blocks, where, axis=-1)
            if qtype == "q5_0":  # GGML's max starts at +0 and moves only on a larger |x| (Q4_0: gguf's sign)
                peak = np.where(peak == 0, np.float32(0), peak)
            d = (peak / np.float32(-(1 << (bits - 1)))).astype(np.float32)
            q = np.trunc(blocks * _inverse(d) + np.float32((1 << (bits - 1)) + 0.5))
            head = [d]
        q = q.astype(np.int32)
        q = (q if qtype == "q5_1" else np.minimum(q, top)).astype(np.uint8)  # Q5_1's (uint8_t) alone
        body = _nibbles(q)
        if bits == 5:
            head.append(np.packbits((q >> 4) & 1, axis=-1, bitorder="little"))  # qh: bit i of a LE uint32
    with np.errstate(over="ignore"):  # a scale or min past fp16's range is inf, as GGML's conversion
        parts = [h.astype(np.float16).view(np.uint8) if h.dtype == np.float32 else h for h in head]  # [n, b, 2 | 4]
    return np.concatenate([*parts, body], axis=-1).reshape(n, -1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] levels -> [..., 16] bytes: byte j holds level j's low 4 bits low, level j + 16's high."""
    return (q[..., : BLOCK // 2] & 0x0F) | ((q[..., BLOCK // 2:] & 0x0F) << 4)


def _levels(body: np.ndarray, qh: np.ndarray | None) -> np.ndarray:
    """Nibble bytes [..., 16] (and qh [..., 4] for Q5) -> the levels [..., 32] as float32."""
    q = np.concatenate([body & 0x0F, body >> 4], axis=-1)
    if qh is not None:
        q = q | (np.unpackbits(qh, axis=-1, bitorder="little") << 4)
    return q.astype(np.float32)


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
    if qtype == "q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32)
        return (q * d).reshape(data.shape[0], k)
    bits, has_min = NIBBLE_TYPES[qtype]
    at = 4 if has_min else 2
    q = _levels(blocks[..., -BLOCK // 2:], blocks[..., at: at + 4] if bits == 5 else None)
    if has_min:  # d * q + m, as GGML's and gguf's dequantizers (two roundings)
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float32)
        return (q * d + m).reshape(data.shape[0], k)
    return ((q - np.float32(1 << (bits - 1))) * d).reshape(data.shape[0], k)


def dequantize_packed(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The v3 GEMV's load-time layout (kernels.gemv.repack) -> [n, k] float32, read from its
    definition: all the blocks' quants first, row after row and block after block (each in its
    GGUF order: 16 bytes for Q4_0, 32 for Q8_0), then all the fp16 scales in the same order. Q4_0
    and Q8_0 only: the GEMV repacks no other 32-weight format."""
    _check(qtype, k)
    if qtype not in PACKED_QTYPES:
        raise ValueError(f"the packed layout is defined for {PACKED_QTYPES} only, got {qtype!r}")
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    n_blocks = k // BLOCK
    quant_bytes = BLOCK_BYTES[qtype] - 2
    if data.size != n * n_blocks * BLOCK_BYTES[qtype]:
        raise ValueError(f"packed {qtype} [{n}, {k}] takes {n * n_blocks * BLOCK_BYTES[qtype]} bytes, got {data.size}")
    body = data[: n * n_blocks * quant_bytes].reshape(n, n_blocks, quant_bytes)
    d = data[n * n_blocks * quant_bytes:].view(np.float16).astype(np.float32).reshape(n, n_blocks, 1)
    q = _levels(body, None) - 8 if qtype == "q4_0" else body.view(np.int8).astype(np.float32)
    return (q * d).reshape(n, k)


# ---- the legacy affine blocks' load-time layout (kernels.gemv.repack): the K-quants' regions ----
# A Q4_1, Q5_0 or Q5_1 matrix [n, k] repacked is its blocks (chunks of 32), row after row, in
# three regions, as many bytes as the GGUF blocks: every block's 16 bytes of nibbles as GGUF has
# them (Q4_0's order); Q5_0/Q5_1 every block's fifth bits as one uint32 in Q5_K's places
# (reference/kquant.py's layout: weight 4t + b at bit 8b + t, weight 16 + 4t + b at 8b + 4 + t);
# then every block's fp16 d (Q5_0) or d and m (Q4_1, Q5_1).
LEGACY_PACKED = ("q4_1", "q5_0", "q5_1")


def high_positions(bits: int) -> np.ndarray:
    """Bit position in its high-bit word of each of a chunk's 32 weights (the repacked layouts':
    bits 1, Q5_K's and the legacy Q5s'; bits 2, Q6_K's, in two words: reference/kquant.py)."""
    w = np.arange(32)
    half, t, b = w // 16, w % 16 // 4, w % 4
    if bits == 1:
        return 8 * b + 4 * half + t
    return 8 * b + 2 * t + 32 * half  # two words: the second's bits 32 on


def pack_legacy(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """GGUF blocks [n, k / 32 * block bytes] -> the repacked bytes (the layout above)."""
    _check(qtype, k)
    if qtype not in LEGACY_PACKED:
        raise ValueError(f"pack_legacy takes {LEGACY_PACKED}, got {qtype!r}")
    blocks = np.asarray(data, dtype=np.uint8).reshape(n * (k // BLOCK), BLOCK_BYTES[qtype])
    bits, has_min = NIBBLE_TYPES[qtype]
    heads = 4 if has_min else 2
    parts = [blocks[:, -BLOCK // 2:].reshape(-1)]
    if bits == 5:
        fifth = np.unpackbits(blocks[:, heads:heads + 4], axis=-1, bitorder="little").astype(np.uint64)
        words = (fifth << high_positions(1).astype(np.uint64)).sum(axis=-1, dtype=np.uint64)
        parts.append(words.astype(np.uint32).view(np.uint8))
    parts.append(blocks[:, :heads].reshape(-1))
    return np.concatenate(parts)


def dequantize_packed_legacy(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The repacked bytes -> [n, k] float32, read from the layout's definition (not by undoing
    pack_legacy): the values dequantize gives for the blocks they came from."""
    _check(qtype, k)
    if qtype not in LEGACY_PACKED:
        raise ValueError(f"dequantize_packed_legacy takes {LEGACY_PACKED}, got {qtype!r}")
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    chunks = n * k // BLOCK
    if data.size != chunks * BLOCK_BYTES[qtype]:
        raise ValueError(f"packed {qtype} [{n}, {k}] takes {chunks * BLOCK_BYTES[qtype]} bytes, got {data.size}")
    bits, has_min = NIBBLE_TYPES[qtype]
    q = _levels(data[: 16 * chunks].reshape(chunks, 16), None).astype(np.int64)
    at = 16 * chunks
    if bits == 5:
        words = data[at: at + 4 * chunks].view(np.uint32).astype(np.uint64)[:, None]
        q |= ((words >> high_positions(1).astype(np.uint64)) & np.uint64(1)).astype(np.int64) << 4
        at += 4 * chunks
    heads = data[at:].view(np.float16).astype(np.float32).reshape(chunks, 2 if has_min else 1)
    d = heads[:, :1]
    if has_min:
        return (q.astype(np.float32) * d + heads[:, 1:]).reshape(n, k)
    return ((q.astype(np.float32) - np.float32(16)) * d).reshape(n, k)


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

