"""GGUF's K-quant block formats Q4_K, Q5_K and Q6_K, from GGML's reference quantizer, in NumPy.

A row of K weights (K a multiple of 256) is K / 256 super-blocks. Each super-block splits into
sub-blocks, each with a scale (and for Q4_K/Q5_K a min) quantized against the super-block's fp16
scales:
- Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
  128 bytes of 4-bit quants. weight = d * sc * q - dmin * m.
- Q5_K, 176 bytes: as Q4_K, plus 32 bytes holding each weight's fifth bit (q in 0..31).
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales for 16
  sub-blocks of 16, fp16 d. weight = d * scale * (q - 32).
The byte layouts are GGML's (ggml-common.h): in each 64 weights of a Q4_K/Q5_K super-block, byte l
holds weight l in its low nibble and weight l + 32 in its high one; Q6_K interleaves 128 weights
over 64 low-nibble bytes and 32 high-bit bytes.

The quantizer follows GGML's reference functions (quantize_row_q{4,5,6}_K_ref with
make_qkx2_quants and make_qx_quants): the same searches over scales, the same weights, and float32
arithmetic in GGML's order, sums accumulated one element after another as its loops do, so that
the bytes are GGML's where its C build evaluates in plain float32 (no fused multiply-add
contraction). The `gguf` package dequantizes these types but does not quantize them.
"""

from __future__ import annotations

import numpy as np

from reference.quant import check_rows, high_positions as _high_positions, quantizable

QK_K = 256
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
QTYPES = tuple(BLOCK_BYTES)
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32


def storage_bytes(qtype: str, n: int, k: int) -> int:
    """Bytes of an [n, k] matrix in `qtype`."""
    check_rows(qtype, k, BLOCK_BYTES, QK_K)
    return n * (k // QK_K) * BLOCK_BYTES[qtype]


def _nearest_int(x: np.ndarray) -> np.ndarray:
    """GGML's nearest_int (the 1.5 * 2^23 trick): round half to even, as int32."""
    return np.rint(x).astype(np.int32)


# ---- the sub-block searches, over many sub-blocks at once, their elements in order ----------------
# Each runs on the transpose ([n, B]: element i of every sub-block is one contiguous row) so that the
# sums over a sub-block's elements, which must go in GGML's order to round as its float32 code does,
# read contiguous rows; the levels are converted to float32 once, not at every use. Same operations
# in the same order as GGML's loops: byte for byte (tests/test_kquant_reference.py).
def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants for each row of x [B, n] with weights w: (scale [B], the_min [B], L [B, n])."""
    n = x.shape[1]
    xt, wt = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)
    lo = np.minimum(xt.min(axis=0), F32(0))
    hi = xt.max(axis=0)
    sum_w, sum_x = wt[0].copy(), wt[0] * xt[0]
    for i in range(1, n):
        sum_w = sum_w + wt[i]
        sum_x = sum_x + wt[i] * xt[i]
    flat = hi == lo
    span = np.where(flat, F32(1), hi - lo)
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    levels = np.clip(_nearest_int(iscale * (xt - lo)), 0, nmax)

    def error(s, m, qf):
        total = np.zeros(xt.shape[1], F32)
        for i in range(n):
            diff = s * qf[i] + m - xt[i]
            total = total + wt[i] * (diff * diff)
        return total

    best = error(scale, lo, levels.astype(F32))
    for step in range(nstep + 1):
        # GGML's loop moves `min` to each better fit, and the next steps start from it
        span = np.where(flat, F32(1), hi - lo)
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / span
        aux = np.clip(_nearest_int(iscale * (xt - lo)), 0, nmax)
        auxf = aux.astype(F32)
        sum_l = np.zeros(xt.shape[1], F32)
        sum_l2, sum_xl = sum_l.copy(), sum_l.copy()
        for i in range(n):
            wl = wt[i] * auxf[i]
            sum_l = sum_l + wl
            sum_l2 = sum_l2 + wl * auxf[i]
            sum_xl = sum_xl + wl * xt[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clamp = this_min > 0
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        this_min = np.where(clamp, F32(0), this_min)
        ok = det > 0
        cur = error(np.where(ok, this_scale, F32(0)), np.where(ok, this_min, F32(0)), auxf)
        better = ok & (cur < best) & ~flat
        levels = np.where(better, aux, levels)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    levels = np.where(flat, 0, levels)
    scale = np.where(flat, F32(0), scale)
    return scale.astype(F32), (-lo).astype(F32), np.ascontiguousarray(levels.T)


def _make_qx(x: np.ndarray, nmax: int):
    """make_qx_quants with rmse_type 1 (weights x^2), for each row of x [B, n]: (scale [B], L [B, n]
    in 0..2 nmax - 1)."""
    n = x.shape[1]
    first = np.abs(x).argmax(axis=1)  # the first of equal magnitudes, as GGML's strict >
    peak = x[np.arange(x.shape[0]), first]
    zero = np.abs(peak) < GROUP_MAX_EPS
    peak = np.where(zero, F32(1), peak)
    xt = np.ascontiguousarray(x.T)
    wgt = xt * xt

    def sums(iscale):
        q = np.clip(_nearest_int(iscale * xt), -nmax, nmax - 1)
        lf = q.astype(F32)
        sumlx = np.zeros(xt.shape[1], F32)
        suml2 = sumlx.copy()
        for i in range(n):
            sumlx = sumlx + wgt[i] * xt[i] * lf[i]
            suml2 = suml2 + wgt[i] * lf[i] * lf[i]
        return q, sumlx, suml2

    q, sumlx, suml2 = sums(F32(-nmax) / peak)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        cand, sumlx, suml2 = sums(-(F32(nmax) + F32(0.1) * F32(step)) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        with np.errstate(divide="ignore", invalid="ignore"):
            new_scale = (sumlx / suml2).astype(F32)
        q = np.where(better, cand, q)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, F32(0), scale), np.ascontiguousarray(np.where(zero, 0, q + nmax).T)


# ---- Q4_K and Q5_K: 8 sub-blocks of 32 with a 6-bit scale and min each --------------------------
def pack_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """[S, 8] 6-bit scales and mins -> [S, 12] bytes (GGML's get_scale_min_k4 layout)."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4]
    out[:, 4:8] = lm[:, :4]
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def unpack_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[S, 12] bytes -> the 8 scales and 8 mins, each [S, 8] int."""
    q = scales.astype(np.int32)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mn


def _quantize_qk(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K/Q5_K's common part for super-blocks x [S, 256]: (d, dmin as fp16 bytes, the 12 scale
    bytes, the levels [S, 256] in 0..nmax)."""
    s = x.shape[0]
    sub = x.reshape(s * 8, 32)
    sum_x2 = np.zeros(s * 8, F32)
    for i in range(32):
        sum_x2 = sum_x2 + sub[:, i] * sub[:, i]
    av_x = np.sqrt(sum_x2 / F32(32)).astype(F32)
    weights = av_x[:, None] + np.abs(sub)
    scales, mins, levels = _make_qkx2(sub, weights, nmax, rmin, 0.1, nstep)
    scales, mins, levels = scales.reshape(s, 8), mins.reshape(s, 8), levels.reshape(s, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    # uint8_t ls = nearest_int(...): a negative value wraps, then MIN(63, .)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = pack_scales_mins(ls, lm)
    d16, dmin16 = (max_scale / F32(63)).astype(np.float16), (max_min / F32(63)).astype(np.float16)
    sc, mn = unpack_scales_mins(packed)
    d = d16.astype(F32)[:, None] * sc.astype(F32)
    dm = dmin16.astype(F32)[:, None] * mn.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        fresh = np.clip(_nearest_int((x.reshape(s, 8, 32) + dm[..., None]) / d[..., None]), 0, nmax)
    levels = np.where((d != 0)[..., None], fresh, levels)  # `if (!d) continue;` keeps the search's
    head = np.concatenate([d16.view(np.uint8).reshape(s, 2), dmin16.view(np.uint8).reshape(s, 2), packed], axis=1)
    return head, levels.reshape(s, QK_K).astype(np.uint8)


def _nibbles(levels: np.ndarray) -> np.ndarray:
    """[S, 256] levels (low 4 bits used) -> [S, 128] bytes: in each 64, l | l + 32 << 4."""
    q = (levels & 0xF).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    head, levels = _quantize_qk(x, 15, -1.0, 20)
    return np.concatenate([head, _nibbles(levels)], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    head, levels = _quantize_qk(x, 31, -0.5, 15)
    high = (levels >> 4).reshape(-1, 4, 2, 32)  # chunk c of 64: bit 2c (first 32), 2c + 1
    qh = np.zeros((levels.shape[0], 32), np.uint8)
    for c in range(4):
        qh |= high[:, c, 0] << (2 * c)
        qh |= high[:, c, 1] << (2 * c + 1)
    return np.concatenate([head, qh, _nibbles(levels)], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    s = x.shape[0]
    sub = x.reshape(s * 16, 16)
    scales, levels = _make_qx(sub, 32)
    scales, levels = scales.reshape(s, 16), levels.reshape(s, 16, 16)
    first = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(s), first]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(empty, F32(0), F32(-128) / np.where(empty, F32(1), max_scale)).astype(F32)
        d16 = np.where(empty, F32(0), F32(1) / iscale).astype(np.float16)
    q_scales = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    d = d16.astype(F32)[:, None] * q_scales.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        fresh = np.clip(_nearest_int(x.reshape(s, 16, 16) / d[..., None]), -32, 31) + 32
    levels = np.where((d != 0)[..., None], fresh, levels).reshape(s, 2, 4, 32).astype(np.uint8)
    low = levels & 0xF  # [S, half, quarter, 32]: half h holds weights 128 h .. 128 h + 127
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    hi = levels >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(s, 128), qh.reshape(s, 64), q_scales.view(np.uint8),
                          d16.view(np.uint8).reshape(s, 2)], axis=1)
    out[empty] = 0
    return out


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """[n, k] floats -> [n, k / 256 * block bytes] uint8 super-blocks."""
    w = quantizable(w, qtype, BLOCK_BYTES, QK_K)
    n, k = w.shape
    x = w.reshape(n * (k // QK_K), QK_K)
    body = {"q4_k": _quantize_q4_k, "q5_k": _quantize_q5_k, "q6_k": _quantize_q6_k}[qtype]
    # Super-blocks are independent: a thousand at a time keep the searches' temporaries in the
    # CPU's caches (an 8B matrix at once made arrays of 235 MB each).
    return np.concatenate([body(x[i:i + _CHUNK]) for i in range(0, len(x), _CHUNK)]).reshape(n, -1)


_CHUNK = 1024  # super-blocks a pass of quantize(): 2048x14336 Q4_K in 3.5 s, 10.1 s at once


def dequantize(data: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """[n, k / 256 * block bytes] uint8 super-blocks -> [n, k] float32 (GGML's dequantize_row_*)."""
    check_rows(qtype, k, BLOCK_BYTES, QK_K)
    data = np.asarray(data, dtype=np.uint8)
    per_row = k // QK_K * BLOCK_BYTES[qtype]
    if data.ndim != 2 or data.shape[1] != per_row:
        raise ValueError(f"{qtype} data for rows of {k} must be [n, {per_row}] bytes, got {data.shape}")
    b = data.reshape(-1, BLOCK_BYTES[qtype])
    scales = b[:, 192:210] if qtype == "q6_k" else b[:, :16]  # what _values reads of each
    return _values(levels(data, qtype, k), qtype, scales).reshape(data.shape[0], k)


def _values(lv: np.ndarray, qtype: str, scales: np.ndarray) -> np.ndarray:
    """Levels (any shape of whole super-blocks) and each super-block's scale bytes [S, 16 or 18]
    (Q4_K/Q5_K: d, dmin, the 12 bytes of 6-bit scales and mins; Q6_K: 16 int8 scales, then d) ->
    the weights [S, 256] float32, in GGML's order of operations."""
    supers = scales.shape[0]
    if qtype == "q6_k":
        sc = np.ascontiguousarray(scales[:, :16]).view(np.int8).astype(F32).reshape(-1, 16, 1)
        d = np.ascontiguousarray(scales[:, 16:18]).view(np.float16).astype(F32).reshape(-1, 1, 1)
        q = (lv.reshape(supers, 16, 16).astype(np.int32) - 32).astype(F32)
        return (d * sc * q).reshape(supers, QK_K)
    d = np.ascontiguousarray(scales[:, 0:2]).view(np.float16).astype(F32).reshape(-1)
    dmin = np.ascontiguousarray(scales[:, 2:4]).view(np.float16).astype(F32).reshape(-1)
    sc, mn = unpack_scales_mins(scales[:, 4:16])
    scale = (d[:, None] * sc.astype(F32))[..., None]
    offset = (dmin[:, None] * mn.astype(F32))[..., None]
    return (scale * lv.reshape(supers, 8, 32).astype(F32) - offset).reshape(supers, QK_K)


# ---- the v3 GEMV's load-time layout (kernels.gemv.repack): the spec the device repack must meet ----
# A K-quant matrix [n, k] repacked is its chunks of 32 weights (a Q4_K/Q5_K sub-block; two Q6_K
# ones), row after row, in three regions, as many bytes as the GGUF super-blocks:
# - quants, 16 bytes a chunk: byte b holds the low 4 bits of weight b of the chunk in its low
#   nibble and of weight 16 + b in its high one (Q4_0's order, so one decode serves both);
# - high bits, Q5_K 4 bytes a chunk (one uint32: the fifth bit of weight 4t + b at bit 8b + t, of
#   weight 16 + 4t + b at bit 8b + 4 + t), Q6_K 8 bytes (two uint32, weights 0..15 and 16..31:
#   bits 4-5 of weight 16s + 4t + b at bits 8b + 2t of word s): shifted and masked, four weights'
#   high bits land in the four bytes of a word, next to their nibbles;
# - scales: Q4_K/Q5_K each super-block's first 16 bytes as GGUF has them (d, dmin, the 12 bytes
#   of 6-bit scales and mins); Q6_K each super-block's 16 int8 scales, then every fp16 d.
def levels(data: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """[n, k / 256 * block bytes] super-blocks -> each weight's quantized level [n, k] (uint8:
    Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, before Q6_K's -32)."""
    check_rows(qtype, k, BLOCK_BYTES, QK_K)
    b = np.asarray(data, dtype=np.uint8).reshape(-1, BLOCK_BYTES[qtype])
    n = np.asarray(data).shape[0]
    if qtype == "q6_k":
        ql, qh = b[:, :128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 32)
        low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        return (low | (high << 4)).reshape(n, k)
    qs = b[:, -128:].reshape(-1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32)
    if qtype == "q5_k":
        q = q | (np.stack([(b[:, 16:48] >> j) & 1 for j in range(8)], axis=1) << 4)
    return q.reshape(n, k).astype(np.uint8)


def pack(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """GGUF super-blocks [n, k / 256 * block bytes] -> the repacked bytes (the layout above)."""
    data = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    lv = levels(data, qtype, k).reshape(n, k // 32, 32)
    quants = (lv[..., :16] & 0xF) | ((lv[..., 16:] & 0xF) << 4)
    parts = [quants.reshape(-1)]
    if qtype != "q4_k":
        bits = 1 if qtype == "q5_k" else 2
        high = (lv >> 4).astype(np.uint64) << _high_positions(bits).astype(np.uint64)
        words = high.sum(axis=-1, dtype=np.uint64)  # no two weights share a bit: the sum is an or
        dtype = np.uint32 if bits == 1 else np.uint64
        parts.append(words.astype(dtype).view(np.uint8).reshape(-1))
    blocks = data.reshape(n, k // QK_K, BLOCK_BYTES[qtype])
    if qtype == "q6_k":
        parts += [blocks[..., 192:208].reshape(-1), blocks[..., 208:210].reshape(-1)]
    else:
        parts.append(blocks[..., :16].reshape(-1))
    return np.concatenate(parts)


def dequantize_packed(data: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The repacked bytes -> [n, k] float32, read from the layout's definition (not by undoing
    pack): the values dequantize gives for the super-blocks they came from."""
    check_rows(qtype, k, BLOCK_BYTES, QK_K)
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    if data.size != storage_bytes(qtype, n, k):
        raise ValueError(f"packed {qtype} [{n}, {k}] takes {storage_bytes(qtype, n, k)} bytes, got {data.size}")
    chunks, supers = n * k // 32, n * k // QK_K
    quants = data[: 16 * chunks].reshape(chunks, 16)
    lv = np.concatenate([quants & 0xF, quants >> 4], axis=1).astype(np.int32)
    at = 16 * chunks
    if qtype != "q4_k":
        bits = 1 if qtype == "q5_k" else 2
        size = 4 * bits
        words = data[at: at + size * chunks].reshape(chunks, size).view(np.uint32 if bits == 1 else np.uint64)
        high = (words.astype(np.uint64) >> _high_positions(bits).astype(np.uint64)) & np.uint64((1 << bits) - 1)
        lv |= high.astype(np.int32) << 4
        at += size * chunks
    if qtype == "q6_k":  # the int8 scales, then every d: one super-block's 18 bytes side by side
        scales = np.concatenate([data[at: at + 16 * supers].reshape(supers, 16),
                                 data[at + 16 * supers:].reshape(supers, 2)], axis=1)
    else:
        scales = data[at:].reshape(supers, 16)
    return _values(lv, qtype, scales).reshape(n, k)
