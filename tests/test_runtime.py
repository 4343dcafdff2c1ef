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


def test_include_line_names_a_file_that_holds_the_text(tmp_path):
    # on CUDA, MLX gets this line instead of a kernel's text (it hashes its source every launch)
    text = "// a body\ny[0] = x[0] + 1.0f;\n"
    line = runtime.include_line(text, ".body.cuh", tmp_path)
    assert line.startswith('#include "') and line.endswith('"\n') and len(line) < 200
    path = line.split('"')[1]
    assert open(path).read() == text
    assert runtime.include_line(text, ".body.cuh", tmp_path) == line  # same text, same file
    other = runtime.include_line(text + "y[1] = 0;\n", ".body.cuh", tmp_path)
    assert other != line and open(other.split('"')[1]).read().endswith("y[1] = 0;\n")
    open(path, "w").write("damaged")  # a file that no longer holds its text is written again
    assert runtime.include_line(text, ".body.cuh", tmp_path) == line and open(path).read() == text
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
