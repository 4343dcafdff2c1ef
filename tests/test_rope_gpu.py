"""The RoPE family on the GPU: every kernel, pairing, frequency path and cache-write form against
the float64 reference (the same cases as `lathe check rope`), and the in-place form's ordering."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kernels.rope as kr
import reference.rope as ref
from reference import rel_err

pytestmark = pytest.mark.gpu

def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


def _decode_inputs(rng, n_heads=8, n_kv=2, d=64, max_seq=40):
    qkv = _rand(rng, (n_heads + 2 * n_kv) * d)
    return qkv, _rand(rng, n_kv, max_seq, d), _rand(rng, n_kv, max_seq, d)


def test_in_place_write_then_read_in_one_graph():
    """A GPU reader that takes the write's token, in the same graph, sees the written row."""
    rng = np.random.default_rng()
    qkv, k0, v0 = _decode_inputs(rng)
    res = kr.rope_qkv_write(mx.array(qkv), mx.array(k0), mx.array(v0), 17, n_heads=8)
    k_rows = kr.cache_read(res.k_cache, 16, 3, after=res.written)
    v_rows = kr.cache_read(res.v_cache, 16, 3, after=res.written)
    mx.eval(k_rows, v_rows)  # one graph: write and reads
    d = 64
    want_k = ref.rope(qkv[8 * d:10 * d].reshape(1, 2, d), [17]).reshape(2, d)
    k_rows, v_rows = np.array(k_rows), np.array(v_rows)
    assert rel_err(k_rows[:, 1], want_k) < 1e-3
    np.testing.assert_array_equal(v_rows[:, 1], qkv[10 * d:].reshape(2, d))
    np.testing.assert_array_equal(k_rows[:, [0, 2]], k0[:, [16, 18]])  # neighbours untouched


@pytest.mark.parametrize("neox", [False, True])
def test_in_place_chain_of_tokens_in_one_eval_matches_functional(neox):
    """32 tokens written in one evaluation, each followed by a reader of every row so far that
    takes the write's token: bit-identical to the functional form, and to the reference.

    As in a decode loop, token n's QKV comes out of what read the cache after token n-1 (there:
    attention; here: a term that is zero but depends on the reader), so each write is ordered
    after the previous reader, and the latest token orders a reader after every earlier write."""
    rng = np.random.default_rng()
    n_heads, n_kv, d, max_seq, start, steps = 8, 2, 64, 64, 5, 32
    tokens = [_rand(rng, (n_heads + 2 * n_kv) * d) for _ in range(steps)]
    k0, v0 = _rand(rng, n_kv, max_seq, d), _rand(rng, n_kv, max_seq, d)
    no_token = mx.zeros((1,), mx.uint32)
    results = {}
    for form in ("in_place", "functional"):
        kc, vc, qs, probes, done = mx.array(k0), mx.array(v0), [], [], []
        for n, qkv in enumerate(tokens):
            qkv = mx.array(qkv)
            if probes:  # the data flow of a decode loop: this token's input depends on the last read
                qkv = qkv + (0 * probes[-1][0, 0, 0])
            res = kr.rope_qkv_write(qkv, kc, vc, start + n, n_heads=n_heads, neox=neox, form=form)
            kc, vc = res.k_cache, res.v_cache
            after = no_token if res.written is None else res.written
            done.append(after)
            qs.append(res.q)
            probes.append(kr.cache_read(kc, 0, start + n + 1, after=after))
        final = kr.cache_read(kc, 0, max_seq, after=mx.concatenate(done))
        mx.eval(qs, probes, final)
        results[form] = ([np.array(q) for q in qs], [np.array(p) for p in probes], np.array(final))
    (q_a, p_a, k_a), (q_b, p_b, k_b) = results["in_place"], results["functional"]
    for a, b in zip(q_a, q_b):
        np.testing.assert_array_equal(a, b)
    for n, (a, b) in enumerate(zip(p_a, p_b)):
        np.testing.assert_array_equal(a, b, err_msg=f"the reader after token {n} saw another cache")
    np.testing.assert_array_equal(k_a, k_b)
    k_new = np.stack([t[n_heads * d:(n_heads + n_kv) * d].reshape(n_kv, d) for t in tokens])
    want = ref.rope(k_new, np.arange(start, start + steps), neox=neox).transpose(1, 0, 2)
    assert rel_err(k_a[:, start:start + steps], want) < 1e-3
    np.testing.assert_array_equal(k_a[:, :start], k0[:, :start])
    np.testing.assert_array_equal(k_a[:, start + steps:], k0[:, start + steps:])


def test_device_position_past_the_cache_writes_nothing():
    """A position array read on the device cannot be checked before launch: out-of-range rows
    are dropped by the kernel, never written out of bounds."""
    rng = np.random.default_rng()
    qkv, k0, v0 = _decode_inputs(rng, max_seq=8)
    res = kr.rope_qkv_write(mx.array(qkv), mx.array(k0), mx.array(v0), mx.array([8], mx.int32),
                            n_heads=8)
    mx.eval(res)
    np.testing.assert_array_equal(np.array(res.k_cache), k0)
    np.testing.assert_array_equal(np.array(res.v_cache), v0)
