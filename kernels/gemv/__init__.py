"""Quantized GEMV on GGUF blocks (Q4_0, Q8_0): Y[M, N] = X[M, K] @ W^T, fp16 X and Y.

W is the [N, K / 32 * block bytes] uint8 matrix of reference.quant (GGUF's own bytes; a GGUF
tensor of ne = (K, N) read row after row). v1 only, so far: one SIMD group per output row.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kernels.runtime import KernelSpec, Launch, launch

QTYPES = {"q4_0": (0, 18), "q8_0": (1, 34)}
MAX_M = 4
ROWS_PER_THREADGROUP = 4  # v1: SIMD groups (rows) per threadgroup

_GEMV_V1 = KernelSpec(name="lathe_gemv_v1", body="gemv/gemv.metal",
                      inputs=("x", "w", "w_half", "dims"), outputs=("y",))


@functools.lru_cache(maxsize=256)
def _dims(n: int, k: int) -> mx.array:
    return mx.array([n, k], dtype=mx.int32)


def check_gemv_args(x: mx.array, w: mx.array, qtype: str, n: int, k: int) -> None:
    """Every argument check of the GEMV kernels (before any launch)."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {tuple(QTYPES)}, got {qtype!r}")
    if k <= 0 or k % 32:
        raise ValueError(f"K must be a positive multiple of 32, got {k}")
    if n <= 0:
        raise ValueError(f"N must be positive, got {n}")
    if not isinstance(x, mx.array) or x.dtype != mx.float16:
        raise ValueError(f"activations must be float16, got {getattr(x, 'dtype', type(x))}")
    if x.ndim != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x must be [M, K={k}] with M in 1..{MAX_M}, got {tuple(x.shape)}")
    row_bytes = k // 32 * QTYPES[qtype][1]
    if not isinstance(w, mx.array) or w.dtype != mx.uint8:
        raise ValueError(f"w must be uint8 blocks, got {getattr(w, 'dtype', type(w))}")
    if w.size != n * row_bytes:
        raise ValueError(f"w has {w.size} bytes; {qtype} [N={n}, K={k}] takes {n * row_bytes} "
                         f"(N * K/32 blocks of {QTYPES[qtype][1]} bytes)")
    if n * row_bytes > 2**31 - 1 or x.size > 2**31 - 1:
        raise ValueError("the kernels index with 32-bit integers: the matrix is too large")


def gemv_v1(x: mx.array, w: mx.array, qtype: str, n: int, k: int) -> mx.array:
    """Y[M, N] = X[M, K] @ W^T, W in `qtype` blocks; v1: one SIMD group per output row."""
    check_gemv_args(x, w, qtype, n, k)
    w = w.reshape(-1)
    code, _ = QTYPES[qtype]
    m = x.shape[0]
    groups = -(-n // ROWS_PER_THREADGROUP)
    (y,) = launch(Launch(_GEMV_V1, [x, w, w.view(mx.float16), _dims(n, k)], [((m, n), mx.float16)],
                         (groups * 32 * ROWS_PER_THREADGROUP, 1, 1),
                         (32 * ROWS_PER_THREADGROUP, 1, 1),
                         dict(QTYPE=code, M=m, NSIMD=ROWS_PER_THREADGROUP)))
    return y
