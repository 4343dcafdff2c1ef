"""reference/rope.py on the CPU: against mx.fast.rope and mx.fast.rms_norm (independent second
opinions), the relative-position property, and the composite against its parts."""

from __future__ import annotations

import numpy as np
import pytest

import reference.rope as ref
from harness.suites.rope import shapes
from reference import rel_err

def test_pairings_differ_and_preserve_norms():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 8))
    a, b = ref.rope(x, np.arange(3, 7)), ref.rope(x, np.arange(3, 7), neox=True)
    assert not np.allclose(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=-1), np.linalg.norm(x, axis=-1))
    np.testing.assert_allclose(ref.rope(x, np.zeros(4)), x)  # position 0 turns nothing


def test_rope_kv_write_is_norm_then_rope_then_write():
    rng = np.random.default_rng(1)
    seq, hq, hkv, d, pos = 3, 4, 2, 8, 5
    q, k, v = (rng.standard_normal((seq, n, d)) for n in (hq, hkv, hkv))
    kc, vc = rng.standard_normal((2, hkv, 10, d))
    qn, kn = rng.standard_normal((2, d))
    q_rot, kc2, vc2 = ref.rope_kv_write(q, k, v, kc, vc, pos, neox=True, q_norm=qn, k_norm=kn)
    positions = np.arange(pos, pos + seq)
    np.testing.assert_allclose(q_rot, ref.rope(ref.rms_norm(q, qn, 1e-6), positions, neox=True))
    want_k = ref.rope(ref.rms_norm(k, kn, 1e-6), positions, neox=True)
    np.testing.assert_allclose(kc2[:, pos:pos + seq], want_k.transpose(1, 0, 2))
    np.testing.assert_array_equal(vc2[:, pos:pos + seq], v.transpose(1, 0, 2))
    np.testing.assert_array_equal(np.delete(kc2, np.s_[pos:pos + seq], 1), np.delete(kc, np.s_[pos:pos + seq], 1))
    with pytest.raises(ValueError, match="outside a cache"):
        ref.rope_kv_write(q, k, v, kc, vc, 8)


def test_custom_frequency_table_is_used():
    x = np.ones((1, 1, 4))
    got = ref.rope(x, [1], freqs=np.array([np.pi / 2, 0.0]))
    np.testing.assert_allclose(got[0, 0], [-1, 1, 1, 1], atol=1e-12)


def test_rel_err_flags_nan_and_shape():
    assert rel_err(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == float("inf")
    with pytest.raises(ValueError):
        rel_err(np.zeros(3), np.zeros(4))


def test_covering_shapes_meet_every_value():
    from harness.suites.rope import FREQ_SCALES, HEAD_DIMS, HEADS, MAX_POSITION, SEQS, THETAS

    s = shapes()
    for d in HEAD_DIMS:
        assert {x.seq for x in s if x.head_dim == d} == set(SEQS)
    for hq, hkv in HEADS:
        assert {x.seq for x in s if (x.n_heads, x.n_kv_heads) == (hq, hkv)} == set(SEQS)
    assert {x.theta for x in s} == set(THETAS) and {x.freq_scale for x in s} == set(FREQ_SCALES)
    assert max(x.pos + x.seq for x in s) == MAX_POSITION and min(x.pos for x in s) == 0


@pytest.mark.parametrize("neox", [False, True])
def test_rope_is_the_pair_definition(neox):
    """reference.rope (pairs as views) equals the rotation written with pair_indices, exactly."""
    rng = np.random.default_rng()
    x, positions = rng.standard_normal((5, 3, 64)), rng.integers(0, 40000, 5)
    a, b = ref.pair_indices(64, neox)
    ang = ref.angles(positions, ref.inv_freq(64, 500000.0), 0.25)[:, None, :]
    want = np.empty_like(x)
    want[..., a] = x[..., a] * np.cos(ang) - x[..., b] * np.sin(ang)
    want[..., b] = x[..., a] * np.sin(ang) + x[..., b] * np.cos(ang)
    assert np.array_equal(ref.rope(x, positions, 500000.0, 0.25, neox), want)
