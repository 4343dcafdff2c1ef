"""A decoder layer's two halves for decode tokens, in float64 (kernels.blocks' references): each is
the composition of the references of its parts, in the order the kernels run them."""

from __future__ import annotations

import numpy as np

from reference import attention, loop, rope


def attention_block(x: np.ndarray, attn_norm: np.ndarray, eps: float, w_qkv: np.ndarray, w_o: np.ndarray,
                    k_cache: np.ndarray, v_cache: np.ndarray, pos: int, n_heads: int, theta: float,
                    neox: bool, q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None,
                    stored: type | None = None, window: int = 0, scale: float | None = None,
                    softcap: float = 0.0, post_norm: np.ndarray | None = None, bias: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [d_model] (one token at position pos); w_qkv [(Hq + 2 Hkv) D, d_model] and w_o [d_model,
    Hq D] as float values; caches [Hkv, max_seq, D] holding rows 0..pos-1. Returns (x + attention
    output @ w_o^T, k_cache, v_cache), the caches copies with row pos written: RMSNorm, the QKV
    projection, (Qwen3: per-head RMSNorm of Q and K), RoPE at pos, the KV write, grouped-query
    attention over rows 0..pos (scale 1/sqrt(D)), the output projection, the residual add.
    stored (np.float16 for the kernels' blocks): the type that QKV and the attention output are
    kept in between the steps, rounded to it as the kernels round them. Attention over random
    keys is close to an argmax, and the fp16 rounding of Q and K alone moves its output by up to
    ~3e-3 (relative) against float64 throughout; None keeps every step in float64.
    Gemma's layer: `window` (> 0) attends to the last `window` rows only, `scale` replaces
    1/sqrt(D), `softcap` (> 0) caps the scores, and `post_norm` RMS-norms the block's output
    (kept in `stored`, as the kernels keep it) before the residual add. Qwen2's layer: `bias`
    [(Hq + 2 Hkv) D] is added to the projection before it is kept."""
    n_kv, _, d = k_cache.shape
    keep = (lambda a: a.astype(stored).astype(np.float64)) if stored else (lambda a: a)  # noqa: E731
    qkv = loop.rmsnorm(x, attn_norm, eps) @ np.asarray(w_qkv, np.float64).T
    qkv = keep(qkv if bias is None else qkv + np.asarray(bias, np.float64))
    q, k, v = np.split(qkv, [n_heads * d, (n_heads + n_kv) * d])
    q, k, v = q.reshape(1, n_heads, d), k.reshape(1, n_kv, d), v.reshape(1, n_kv, d)
    q_rot, k_cache, v_cache = rope.rope_kv_write(q, k, v, k_cache, v_cache, pos, theta=theta, neox=neox,
                                                 q_norm=q_norm, k_norm=k_norm, eps=eps)
    first = max(0, pos + 1 - window) if window else 0
    keys, values = (c[:, first: pos + 1].transpose(1, 0, 2) for c in (k_cache, v_cache))
    o = keep(attention.attend(q_rot[0], keys, values, d ** -0.5 if scale is None else scale, softcap).reshape(-1))
    return _residual(x, o @ np.asarray(w_o, np.float64).T, post_norm, eps, keep), k_cache, v_cache


def _residual(x: np.ndarray, out: np.ndarray, post_norm: np.ndarray | None, eps: float, keep) -> np.ndarray:
    """x + a block's output, RMS-normed first where the layer has a post-norm (its output kept
    in the stored type first, as the kernels keep it)."""
    if post_norm is None:
        return np.asarray(x, np.float64) + out
    return np.asarray(x, np.float64) + loop.rmsnorm(keep(out), post_norm, eps)


def ffn_block(x: np.ndarray, ffn_norm: np.ndarray, eps: float, w_gate_up: np.ndarray, w_down: np.ndarray,
              activation: str = "silu", post_norm: np.ndarray | None = None, stored: type | None = None
              ) -> np.ndarray:
    """x [M, d_model] -> x + (act(X' W_gate^T) * (X' W_up^T)) @ w_down^T, X' = RMSNorm(x) *
    ffn_norm, w_gate_up = [gate; up] ([2F, d_model]), w_down [d_model, F]; act SiLU or GELU
    (Gemma). post_norm, stored: attention_block's."""
    keep = (lambda a: a.astype(stored).astype(np.float64)) if stored else (lambda a: a)  # noqa: E731
    gate_up = loop.rmsnorm(x, ffn_norm, eps) @ np.asarray(w_gate_up, np.float64).T
    return _residual(x, loop.swiglu(gate_up, activation) @ np.asarray(w_down, np.float64).T, post_norm, eps, keep)
