"""The decode loop's small kernels: argument checks (their cases run in test_families.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import loop

h = lambda *s: mx.zeros(s, mx.float16)  # noqa: E731

BAD = [
    (lambda: loop.rmsnorm(h(1, 12), h(12), 1e-5), "multiple of 8"),
    (lambda: loop.rmsnorm(mx.zeros((1, 8), mx.int32), h(8), 1e-5), "float16 or float32"),
    (lambda: loop.rmsnorm(mx.zeros((1, 8)), h(8), 1e-5, residual=h(1, 8)), "float16, got"),
    (lambda: loop.swiglu(h(1, 16), activation="relu"), "activation must be one of"),
    (lambda: loop.rmsnorm(h(1, 8), h(16), 1e-5), "gamma must be"),
    (lambda: loop.rmsnorm(h(1, 8), h(8), 0.0), "eps"),
    (lambda: loop.rmsnorm(h(1, 8), h(8), 1e-5, h(2, 8)), "residual must be"),
    (lambda: loop.swiglu(h(1, 24)), "multiple of 16"),
    (lambda: loop.argmax(mx.zeros((1, 8), mx.int32)), "float32 or float16"),
    (lambda: loop.argmax(mx.zeros((8,))), "float32 or float16"),
    (lambda: loop.argmax(h(0, 8)), "float32 or float16"),
    (lambda: loop.embed(h(10, 32), [10], "f16", 32), r"0..9"),
    (lambda: loop.embed(h(10, 32), [-1], "f16", 32), r"0..9"),
    (lambda: loop.embed(h(10, 32), [1], "q4_0", 32), "uint8"),
    (lambda: loop.embed(mx.zeros((10, 17), mx.uint8), [1], "q8_0", 32), "rows of 34"),
    (lambda: loop.embed(h(10, 32), [1], "q2_k", 32), "qtype"),
    (lambda: loop.embed(h(10, 32), mx.array([1.0]), "f16", 32), "int32"),
]


@pytest.mark.parametrize("call, message", BAD)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("call, message", [
    (lambda: loop.post_norm_add(h(1, 8), h(8), 1e-6, mx.zeros((1, 8), mx.float16)), "stream must be float32"),
    (lambda: loop.post_norm_add(h(1, 8), h(8), 1e-6, mx.zeros((2, 8))), r"stream must be float32 \[1, 8\]"),
    (lambda: loop.post_norm_add(mx.zeros((1, 8)), h(8), 1e-6, mx.zeros((1, 8))), "x must be float16"),
    (lambda: loop.post_norm_add(h(1, 8), h(16), 1e-6, mx.zeros((1, 8))), "gamma must be float16"),
])
def test_post_norm_add_refuses_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("m", [1, 8, 9, 32])
def test_argmax_host_words_are_two_rows_an_8_byte_output(m):
    """argmax(host_words=True): the int32 [M] tokens and ceil(M / 2) int32 [2] outputs (8 bytes:
    MLX's small managed pool), written by one launch whose prelude names them; tokens_from_words reads
    them back in row order. Recorded, not run."""
    from kernels.runtime import recording

    with recording() as rec:
        tok, words = loop.argmax(mx.zeros((m, 151936), mx.float16), host_words=True)
    (job,) = rec.jobs
    n = -(-m // 2)
    assert tuple(tok.shape) == (m,) and len(words) == n and all(tuple(w.shape) == (2,) for w in words)
    assert job.spec.name == f"lathe_argmax_host{n}" and job.spec.outputs == ("token", *(f"host{i}" for i in range(n)))
    assert all(f"case {i}: host{i}[(ROW) % 2] = (V); break;" in job.spec.prelude for i in range(n))
    given = [mx.array(np.array([2 * i, 2 * i + 1], np.int32)) for i in range(n)]
    assert loop.tokens_from_words(given, m) == list(range(m))


def test_argmax_host_words_stop_at_32_rows():
    """Past ARGMAX_HOST_ROWS the host words are refused before any launch (16 outputs and the
    kernel's own 3 buffers stay within Metal's 31)."""
    from kernels.runtime import recording

    with recording() as rec, pytest.raises(ValueError, match="at most 32 rows"):
        loop.argmax(mx.zeros((33, 64), mx.float16), host_words=True)
    assert not rec.jobs and loop.ARGMAX_HOST_ROWS == 32
