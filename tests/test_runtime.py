"""kernels.runtime helpers that run on any backend (CPU included)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import runtime


@pytest.mark.parametrize("values, dtype", [((1e-5,), mx.float32), ((3, 4, 5), mx.int32),
                                           ((1, 2, 3, 4, 5, 6), mx.int32), ((7,), mx.uint32)])
def test_constant_holds_exactly_its_values(values, dtype):
    # padded out of MLX's small pool, a constant is still seen as its own values only
    c = runtime.constant(values, dtype)
    assert c.shape == (len(values),) and c.dtype == dtype
    np.testing.assert_array_equal(np.array(c), np.array(values, dtype=np.array(c).dtype))



def test_a_constant_is_made_once_per_value():
    assert runtime.constant((2.5,), mx.float32) is runtime.constant((2.5,), mx.float32)
