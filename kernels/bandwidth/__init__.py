"""Memory-bandwidth workloads: the peak that every result is a percentage of."""

from __future__ import annotations

import mlx.core as mx

from kernels.runtime import KernelSpec, Launch, constant, launch

_COPY = KernelSpec(name="lathe_copy16", body="bandwidth/copy.metal", inputs=("src", "dims"),
                   outputs=("dst",))


def copy16(src: mx.array) -> mx.array:
    """A copy of a uint32 array whose size is a multiple of 4, moved in 16-byte words."""
    if src.dtype != mx.uint32 or src.ndim != 1 or src.size % 4:
        raise ValueError(f"src must be a 1-D uint32 array of a multiple of 4 elements, got {src.dtype}{src.shape}")
    n16 = src.size // 4
    if n16 > 2**31 - 1:
        raise ValueError("src is too large for 32-bit thread indices")
    (dst,) = launch(Launch(_COPY, [src, constant((n16,))], [(src.shape, mx.uint32)],
                           (n16, 1, 1), (256, 1, 1)))
    return dst
