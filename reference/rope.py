"""Rotary position embedding (RoPE) and its fused neighbours, in float64.

Head layout: x[seq, n_heads, head_dim]. Pair i of a head turns by the angle
``position * freq_scale * theta ** (-2 i / head_dim)``:
- standard (GPT-J / llama.cpp "normal") pairs are elements (2i, 2i+1);
- NeoX pairs are elements (i, i + head_dim / 2).
KV caches are head-major: cache[n_kv_heads, max_seq, head_dim].
"""

from __future__ import annotations

import numpy as np


def inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """theta ** (-2i / head_dim) for i in 0 .. head_dim/2 - 1."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    return float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def angles(positions: np.ndarray, freqs: np.ndarray, freq_scale: float = 1.0) -> np.ndarray:
    """[len(positions), len(freqs)] rotation angles."""
    pos = np.asarray(positions, dtype=np.float64) * float(freq_scale)
    return np.outer(pos, np.asarray(freqs, dtype=np.float64))


def pair_indices(head_dim: int, neox: bool) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(head_dim // 2)
    return (i, i + head_dim // 2) if neox else (2 * i, 2 * i + 1)


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    theta: float = 10000.0,
    freq_scale: float = 1.0,
    neox: bool = False,
    freqs: np.ndarray | None = None,
) -> np.ndarray:
    """Rotate x[seq, n_heads, head_dim]; token t sits at positions[t]."""
    x = np.asarray(x, dtype=np.float64)
    seq, _, head_dim = x.shape
    if len(positions) != seq:
        raise ValueError(f"{len(positions)} positions for {seq} tokens")
    freqs = inv_freq(head_dim, theta) if freqs is None else np.asarray(freqs, np.float64)
    ang = angles(positions, freqs, freq_scale)[:, None, :]  # [seq, 1, D/2]
    cos, sin = np.cos(ang), np.sin(ang)
    # The pairs of pair_indices as views: NeoX's halves, or the standard layout's (even, odd).
    half = head_dim // 2
    pairs = x.reshape(*x.shape[:-1], half, 2)
    x1, x2 = (x[..., :half], x[..., half:]) if neox else (pairs[..., 0], pairs[..., 1])
    o1, o2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    if neox:
        return np.concatenate([o1, o2], axis=-1)
    return np.stack([o1, o2], axis=-1).reshape(x.shape)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    x = np.asarray(x, dtype=np.float64)
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / rms * np.asarray(weight, dtype=np.float64)


def cache_write(cache: np.ndarray, rows: np.ndarray, pos: int) -> np.ndarray:
    """A copy of cache[n_kv, max_seq, D] with rows[seq, n_kv, D] written at pos .. pos+seq-1."""
    seq = rows.shape[0]
    if pos < 0 or pos + seq > cache.shape[1]:
        raise ValueError(f"rows {pos}..{pos + seq - 1} are outside a cache of {cache.shape[1]}")
    out = np.array(cache, dtype=np.float64, copy=True)
    out[:, pos : pos + seq, :] = np.transpose(rows, (1, 0, 2))
    return out


def rope_kv_write(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    pos: int,
    theta: float = 10000.0,
    freq_scale: float = 1.0,
    neox: bool = False,
    freqs: np.ndarray | None = None,
    q_norm: np.ndarray | None = None,
    k_norm: np.ndarray | None = None,
    eps: float = 1e-6,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The attention prologue for tokens at pos .. pos+seq-1.

    q[seq, n_heads, D], k and v [seq, n_kv_heads, D]. With q_norm/k_norm (Qwen3), Q and K are
    RMS-normed per head first. Returns (rotated q, new k_cache, new v_cache).
    """
    positions = np.arange(pos, pos + q.shape[0])
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm, or neither")
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q_rot = rope(q, positions, theta, freq_scale, neox, freqs)
    k_rot = rope(k, positions, theta, freq_scale, neox, freqs)
    return q_rot, cache_write(k_cache, k_rot, pos), cache_write(v_cache, np.asarray(v), pos)



def yarn_corr_dims(head_dim: int, orig_ctx: int, theta: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pair range over which yarn ramps from interpolated
    (slow pairs) to extrapolated (fast pairs) rotation."""
    def dim(n_rot: float) -> float:
        return head_dim * np.log(orig_ctx / (n_rot * 2 * np.pi)) / (2 * np.log(theta))
    return max(0.0, float(np.floor(dim(beta_fast)))), min(head_dim - 1.0, float(np.ceil(dim(beta_slow))))


def rope_frequencies(head_dim: int, theta: float, freq_scale: float = 1.0, factors: np.ndarray | None = None,
                     yarn: dict | None = None, attn_factor: float = 1.0) -> tuple[np.ndarray, float]:
    """Each pair's angle per position, and the factor on cos and sin, as ggml's rope_yarn turns a
    pair: theta_i = pos * base^(-2i/D) / factor_i (rope_freqs.weight: Llama 3.1), scaled by
    freq_scale (linear: 1 / factor), cos and sin times attn_factor; with yarn (keys ext_factor,
    orig_ctx, beta_fast, beta_slow) pair i mixes the scaled and unscaled angles by its ramp, and
    cos and sin take another 1 + 0.1 ln(1 / freq_scale)."""
    inv = inv_freq(head_dim, theta)
    if factors is not None:
        inv = inv / np.asarray(factors, dtype=np.float64)
    if not yarn or not yarn["ext_factor"]:
        return inv * freq_scale, float(attn_factor)
    low, high = yarn_corr_dims(head_dim, yarn["orig_ctx"], theta, yarn["beta_fast"], yarn["beta_slow"])
    i = np.arange(head_dim // 2)
    ramp = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * yarn["ext_factor"]
    return inv * (freq_scale * (1 - ramp) + ramp), float(attn_factor * (1 + 0.1 * np.log(1 / freq_scale)))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml_gelu; Gemma's gelu_pytorch_tanh)."""
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / (1 + np.exp(-x))
