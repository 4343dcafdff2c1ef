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


@pytest.mark.parametrize("shape", [(2,), (3,), (2048,), (1, 513), (4, 9)])
def test_table_constant_holds_the_table(shape):
    """A block table (any shape, any int dtype on the host) as an int32 constant: the same values
    and shape, small ones through `constant`, long ones cached on their bytes (made once)."""
    table = np.random.default_rng(1).permutation(int(np.prod(shape))).reshape(shape).astype(np.int64)
    c = runtime.table_constant(table)
    assert c.shape == shape and c.dtype == mx.int32
    np.testing.assert_array_equal(np.array(c), table)
    if table.size >= 4:  # 16 bytes of int32 and more: the cached array itself
        assert runtime.table_constant(table.copy()) is c
    other = table.copy()
    other.flat[-1] += 1  # one entry differs: another constant
    np.testing.assert_array_equal(np.array(runtime.table_constant(other)), other)


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


def test_a_cache_written_in_place_must_be_row_contiguous(monkeypatch):
    """A transposed view of a cache (the right shape, the wrong layout) is refused before the
    launch: MLX would bind a row-contiguous copy and the write would be lost. A whole cache goes
    through, is checked once (evaluated, through the buffer protocol), and the caches the kernel
    returns are known whole: the next write reads no buffer and the same view is refused again."""
    from kernels import attention, rope

    evaluated = []
    monkeypatch.setattr(runtime, "memoryview", lambda a: evaluated.append(a.shape) or memoryview(a), raising=False)
    n_kv, seq, d = 2, 16, 64
    qkv = mx.zeros(((4 + 2 * n_kv) * d,), mx.float16)
    cache = mx.zeros((n_kv, seq, d), mx.float16)
    strided = mx.zeros((seq, n_kv, d), mx.float16).transpose(1, 0, 2)
    with runtime.recording("cuda") as rec:
        with pytest.raises(ValueError, match="k_cache is written in place, so it must be a row-contiguous"):
            rope.rope_qkv_write(qkv, strided, cache, 3, n_heads=4)
        with pytest.raises(ValueError, match="rope_flash_decode: v_cache is written in place"):
            attention.rope_flash_decode(qkv, cache, strided, 3, n_heads=4, scale=0.1)
        assert not rec.jobs
        rot = rope.rope_qkv_write(qkv, cache, mx.zeros((n_kv, seq, d), mx.float16), 3, n_heads=4)
        checked = len(evaluated)
        rot = rope.rope_qkv_write(qkv, rot.k_cache, rot.v_cache, 4, n_heads=4)
        attention.rope_flash_decode(qkv, rot.k_cache, rot.v_cache, 5, n_heads=4, scale=0.1)
        assert len(evaluated) == checked and len(rec.jobs) == 3
    with pytest.raises(ValueError, match="written in place"), runtime.recording("cuda"):
        rope.rope_qkv_write(qkv, strided, cache, 3, n_heads=4)


def test_a_traced_cache_is_not_evaluated():
    """Inside mx.compile's trace the caches are placeholders, which cannot be evaluated: the
    in-place check leaves them to the arrays the compiled function is called with."""
    from kernels import rope

    def step(qkv, k_cache, v_cache):
        rot = rope.rope_qkv_write(qkv, k_cache, v_cache, 3, n_heads=4)
        return rot.q, rot.k_cache

    with runtime.recording("cuda") as rec:
        mx.compile(step)(mx.zeros((8 * 64,), mx.float16), mx.zeros((2, 16, 64), mx.float16),
                         mx.zeros((2, 16, 64), mx.float16))
    assert len(rec.jobs) == 1


def test_the_backend_choices_follow_the_target():
    """kernels.backends answers for the backend the launches are made for: on CUDA a launch may
    wait on other threadgroups and a threadgroup declares up to 48 KiB; on Metal neither waits
    (the seam and the blocks run as separate launches) and 32 KiB, with 256 threads at most."""
    from kernels import backends

    for target, waits, memory, threads in (("cuda", True, 48 * 1024, 1024), ("metal", False, 32 * 1024, 256)):
        with runtime.recording(target):
            assert backends.cross_group_waits() is waits
            assert backends.threadgroup_memory() == memory == backends.THREADGROUP_MEMORY[target]
            assert backends.THREADS_PER_THREADGROUP[target] == threads


def test_kernels_prepared_inside_a_recording_are_kept_where_asked():
    """A decoder compiles its token's kernels ahead (prepare_kernels: recorded, then prepare). A
    recording(keep_prepared=True) (`lathe compile --record`, `pytest --record-launches`) keeps
    them, even where the caller stops before launching them; a plain one leaves them out, so that
    counting a forward's launches counts launches."""
    from kernels import rope

    qkv, cache = mx.zeros((8 * 64,), mx.float16), mx.zeros((2, 16, 64), mx.float16)
    for keep in (True, False):
        with runtime.recording("cuda", keep_prepared=keep) as outer:
            with runtime.recording() as inner:
                rope.rope_qkv_write(qkv, cache, mx.zeros((2, 16, 64), mx.float16), 3, n_heads=4)
            assert len(inner.jobs) == 1 and not outer.jobs and not inner.prepared
            assert runtime.prepare(inner.jobs) == (0, {})
            assert outer.prepared == (inner.jobs if keep else []) and not outer.jobs
    assert runtime.prepare(inner.jobs) == (0, {})  # outside a recording, off CUDA: nothing to do
