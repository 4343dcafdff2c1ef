"""The sampling pipeline against a NumPy rendering of each stage."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from harness.program.sampling import Sampler


def logits(n=50, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3


def test_greedy_is_argmax_and_neutral_stages_change_nothing():
    x = logits()
    assert int(Sampler()(mx.array(x))) == int(np.argmax(x))
    np.testing.assert_array_equal(np.array(Sampler().filtered(mx.array(x))), x)


def test_repetition_penalty_follows_ctrl():
    x = logits()
    seen = np.array([int(np.argmax(x)), int(np.argmin(x)), 3, 3])
    got = np.array(Sampler(repetition_penalty=1.5).filtered(mx.array(x), mx.array(seen)))
    want = x.copy()
    for i in set(seen.tolist()):
        want[i] = x[i] / 1.5 if x[i] > 0 else x[i] * 1.5
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_temperature_top_k_top_p_in_order():
    x = logits()
    s = Sampler(temperature=0.7, top_k=10, top_p=0.8)
    got = np.array(s.filtered(mx.array(x)))
    want = x / 0.7
    want[want < np.sort(want)[-10]] = -np.inf
    order = np.argsort(-want)
    p = np.exp(want[order] - want[order][0])
    p /= p.sum()
    drop = order[(np.cumsum(p) - p) >= 0.8]
    want[drop] = -np.inf
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5)
    assert np.isfinite(got).sum() >= 1


def test_seeded_draws_repeat_and_stay_inside_the_kept_set():
    x = mx.array(logits())
    s = Sampler(temperature=1.0, top_k=5, seed=7)
    kept = set(np.argsort(-np.array(x))[:5].tolist())
    draws = [int(s(x, key=mx.random.key(i))) for i in range(40)]
    assert set(draws) <= kept and len(set(draws)) > 1
    assert draws == [int(s(x, key=mx.random.key(i))) for i in range(40)]


@pytest.mark.parametrize("kw", [dict(top_p=0), dict(top_p=1.5), dict(temperature=-1),
                                dict(top_k=-2), dict(repetition_penalty=0)])
def test_bad_settings(kw):
    with pytest.raises(ValueError):
        Sampler(**kw)
