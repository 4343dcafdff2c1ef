"""cuda_compat.h / the portable MSL subset: every mapping, on the GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import compat
from kernels.runtime import poisoned_outputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "grid, tg",
    [((1000, 1, 1), (256, 1, 1)), ((37, 19, 1), (16, 8, 1)), ((5, 7, 9), (4, 2, 2)),
     ((64, 3, 2), (64, 1, 1))],
    ids=["1d-partial", "2d-partial", "3d-partial", "3d-exact"],
)
def test_thread_ids(grid, tg):
    with poisoned_outputs():
        ids = np.array(compat.thread_ids(grid, tg))
    gx, gy, gz = grid
    tx, ty, tz = tg
    z, y, x = np.meshgrid(np.arange(gz), np.arange(gy), np.arange(gx), indexing="ij")
    lx, ly, lz = x % tx, y % ty, z % tz
    flat = lx + tx * (ly + ty * lz)
    want = np.stack([x, y, z, x // tx, y // ty, z // tz, lx, ly, lz,
                     np.full_like(x, tx), np.full_like(x, ty), np.full_like(x, tz),
                     flat, flat % 32, flat // 32, np.ones_like(x)], axis=-1)
    assert not np.isnan(ids).any(), "a thread inside the grid wrote nothing"
    np.testing.assert_array_equal(ids, want)


@pytest.mark.parametrize("mask", [1, 5, 16])
def test_simd_functions(mask):
    n, tg = 100, 64  # the last SIMD group is partial on both backends
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    with poisoned_outputs():
        out = np.array(compat.simd(mx.array(x), tg, mask))
    for start in range(0, n, 32):
        lanes = np.arange(start, min(start + 32, n))
        group = x[lanes]
        np.testing.assert_allclose(out[lanes, 0], group.sum(), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[lanes, 1], group.max())
        np.testing.assert_array_equal(out[lanes, 3], group[0])
        if len(lanes) == 32:  # a partner outside the grid has no defined value on Metal
            np.testing.assert_array_equal(out[lanes, 2], x[start + ((lanes - start) ^ mask)])


@pytest.mark.parametrize("tg", [32, 256])
def test_threadgroup_memory_barrier_half_and_wide_loads(tg):
    """Also half2 and half4 (.xy/.zw) through load_wide/store_wide."""
    n = 1000  # not a multiple of tg: a partial last threadgroup
    rng = np.random.default_rng()
    x = rng.standard_normal(n).astype(np.float16)
    wide = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    pairs = rng.standard_normal(n).astype(np.float16)
    with poisoned_outputs():
        rev, sums, wide_out, pairs_out, quads_out = (np.array(a) for a in compat.memory(
            mx.array(x), mx.array(wide), mx.array(pairs), tg))
    padded = np.zeros(-(-n // tg) * tg, np.float32)
    padded[:n] = x.astype(np.float32)
    groups = padded.reshape(-1, tg)
    want_rev = (2 * groups[:, ::-1]).reshape(-1)[:n].astype(np.float16)
    want_sums = np.repeat(groups.sum(axis=1), tg)[:n]
    np.testing.assert_array_equal(rev, want_rev)
    np.testing.assert_allclose(sums, want_sums, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(wide_out, wide)
    np.testing.assert_array_equal(pairs_out, pairs.reshape(-1, 2)[:, ::-1].reshape(-1))
    np.testing.assert_array_equal(quads_out, pairs.reshape(-1, 2, 2)[:, ::-1].reshape(-1))


@pytest.mark.parametrize("column, row, tg", [(0, 0, (32, 1, 1)), (3, 5, (32, 1, 1)), (8, 0, (32, 1, 1)),
                                             (3, 5, (8, 4, 1))],
                         ids=["aligned", "odd-column", "right-block", "2d-threadgroup"])
def test_simdgroup_matrix(column, row, tg):
    """Metal's 8x8 SIMD-group matrices: loads (plain, transposed, unaligned), stores (plain,
    transposed), the multiply with fp32 and fp16 sums, the thread_elements() layout that
    lathe.h's sg8x8_row/col and row reductions describe, and lathe.h's paired products."""
    rng = np.random.default_rng()
    big = rng.standard_normal((16, 16)).astype(np.float16)
    c = rng.standard_normal((8, 8)).astype(np.float32)
    with poisoned_outputs():
        out = np.array(compat.simdgroup_matrix(mx.array(big), mx.array(c), column, row, tg))
    a = big[row:row + 8, column:column + 8].astype(np.float64)
    b = big[8:, 8:].astype(np.float64)
    want = a @ b + c
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out[1], (a @ b + c.astype(np.float16)), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(out[2], a.T @ b.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out[3], a.T)
    np.testing.assert_array_equal(out[4], c.T)
    np.testing.assert_array_equal(out[5], out[0])
    np.testing.assert_allclose(out[6][:, 0], out[0].sum(axis=1), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out[6][:, 1], out[0].max(axis=1))
    np.testing.assert_array_equal(out[6][:, 2:], 0)
    np.testing.assert_allclose(out[7], c + a @ b + a.T @ b.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out[8], c + a @ b + a.T @ b.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out[9], c + b @ b + b.T @ b.T, rtol=1e-5, atol=1e-4)
