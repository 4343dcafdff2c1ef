"""The sequences a fused RoPE kernel replaces, kept for comparison (same signature as the fused
kernels, same results):

- ``unfused``: one of our kernels per op (head RMSNorm of Q, of K; RoPE of Q, of K; K write;
  V write), in the in-place form, or in the functional form with MLX slice updates for the writes;
- ``mlx``: MLX built-ins (``mx.fast.rms_norm``, ``mx.fast.rope``, slice updates), the peer path
  that an mlx-lm style loop runs.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.rope import Rotated, cache_write, head_rmsnorm, position, rope, rope_neox


def _split(q, k, v, k_cache):
    n_kv, _, head_dim = k_cache.shape
    seq = q.shape[0]
    return (q.reshape(seq, -1, head_dim), k.reshape(seq, n_kv, head_dim),
            v.reshape(seq, n_kv, head_dim))


def _write(cache, rows, pos, form):
    """rows[seq, n_kv, D] into cache rows pos..: our kernel (in place, with its ordering token)
    or an MLX slice update (no token)."""
    if form == "in_place":
        return cache_write(rows, cache, pos)
    return mx.slice_update(cache, rows.transpose(1, 0, 2), position(pos), axes=(1,)), None


def unfused_kv_write(q, k, v, k_cache, v_cache, pos, *, neox=False, theta=10000.0,
                     freq_scale=1.0, q_norm=None, k_norm=None, eps=1e-6, form="in_place") -> Rotated:
    """Norms (if given), RoPE of Q, RoPE of K, K write, V write: one of our kernels each."""
    q, k, v = _split(q, k, v, k_cache)
    if q_norm is not None:
        q, k = head_rmsnorm(q, q_norm, eps), head_rmsnorm(k, k_norm, eps)
    turn = rope_neox if neox else rope
    q = turn(q, pos, theta=theta, freq_scale=freq_scale)
    k = turn(k, pos, theta=theta, freq_scale=freq_scale)
    (k_cache, k_done), (v_cache, v_done) = _write(k_cache, k, pos, form), _write(v_cache, v, pos, form)
    written = None if k_done is None else mx.concatenate([k_done, v_done])
    return Rotated(q, k_cache, v_cache, written)


def mlx_kv_write(q, k, v, k_cache, v_cache, pos, *, neox=False, theta=10000.0, freq_scale=1.0,
                 q_norm=None, k_norm=None, eps=1e-6) -> Rotated:
    """MLX built-ins: mx.fast.rms_norm, mx.fast.rope (heads first, as mlx-lm lays them out) and
    slice updates of the caches."""
    q, k, v = _split(q, k, v, k_cache)
    if q_norm is not None:
        q = mx.fast.rms_norm(q, q_norm.astype(mx.float16), eps)
        k = mx.fast.rms_norm(k, k_norm.astype(mx.float16), eps)
    offset = pos if isinstance(pos, mx.array) else int(pos)
    if isinstance(offset, mx.array):
        offset = offset.reshape(())

    def turn(x):  # [seq, heads, D] -> heads-first [1, heads, seq, D] for mx.fast.rope
        x = x.transpose(1, 0, 2)[None]
        return mx.fast.rope(x, x.shape[-1], traditional=not neox, base=theta, scale=freq_scale,
                            offset=offset)[0]

    q_rot = turn(q).transpose(1, 0, 2)
    k_rot = turn(k)  # [n_kv, seq, D], the cache's own layout
    start = position(pos)
    return Rotated(
        q_rot,
        mx.slice_update(k_cache, k_rot, start, axes=(1,)),
        mx.slice_update(v_cache, v.transpose(1, 0, 2), start, axes=(1,)),
    )
