"""Probes of cuda_compat.h / the portable MSL subset, run by tests/test_compat_gpu.py."""

from __future__ import annotations

import mlx.core as mx

from kernels.runtime import KernelSpec, Launch, launch

_IDS = KernelSpec("lathe_probe_thread_ids", "compat/thread_ids.metal", ("dims",), ("ids",))
_SIMD = KernelSpec("lathe_probe_simd", "compat/simd.metal", ("x", "dims"), ("out",))
_MEMORY = KernelSpec("lathe_probe_memory", "compat/memory.metal",
                     ("x", "wide_in", "pairs_in", "dims"),
                     ("rev", "sums", "wide_out", "pairs_out", "quads_out"),
                     threadgroup_bytes=lambda c: 4 * (c["TG"] + c["TG"] // 32))


def thread_ids(grid: tuple[int, int, int], threadgroup: tuple[int, int, int]) -> mx.array:
    """[gz, gy, gx, 16] ids as written by each thread (see thread_ids.metal)."""
    gx, gy, gz = grid
    (ids,) = launch(Launch(_IDS, [mx.array(grid, dtype=mx.int32)], [((gz, gy, gx, 16), mx.float32)],
                           grid, threadgroup))
    return ids


def simd(x: mx.array, threadgroup: int, mask: int) -> mx.array:
    """[n, 4]: simd_sum, simd_max, simd_shuffle_xor(mask), simd_broadcast_first of x."""
    n = x.size
    (out,) = launch(Launch(_SIMD, [x, mx.array([n], dtype=mx.int32)], [((n, 4), mx.float32)],
                           (n, 1, 1), (threadgroup, 1, 1), {"MASK": mask}))
    return out


def memory(x: mx.array, wide_in: mx.array, pairs_in: mx.array, threadgroup: int) -> list[mx.array]:
    """rev, sums, wide_out, pairs_out, quads_out (see memory.metal); x and pairs_in have n halves,
    wide_in n uint32."""
    n = x.size
    return launch(Launch(_MEMORY, [x, wide_in, pairs_in, mx.array([n], dtype=mx.int32)],
                         [((n,), mx.float16), ((n,), mx.float32), ((n,), mx.uint32), ((n,), mx.float16),
                          ((n,), mx.float16)],
                         (n, 1, 1), (threadgroup, 1, 1), {"TG": threadgroup}))


_SIMDGROUP_MATRIX = KernelSpec("lathe_probe_simdgroup_matrix", "compat/simdgroup_matrix.metal",
                               ("big", "c", "dims"), ("out", "scratch"))


def simdgroup_matrix(big: mx.array, c: mx.array, column: int, row: int,
                     threadgroup: tuple[int, int, int] = (32, 1, 1)) -> mx.array:
    """[10, 8, 8] float: the products, transposes and fragment reads of simdgroup_matrix.metal;
    big is half [16, 16], c float [8, 8], A big's block from (row, column); one SIMD group, as
    a threadgroup of this shape (32 threads)."""
    out, _ = launch(Launch(_SIMDGROUP_MATRIX, [big, c, mx.array([column, row], dtype=mx.int32)],
                           [((10, 8, 8), mx.float32), ((2, 8, 8), mx.float16)], threadgroup, threadgroup))
    return out
