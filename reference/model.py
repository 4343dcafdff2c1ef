"""A float64 forward pass of a llama / qwen3 GGUF model: the oracle of the decode loop.

`model` is anything with `.config` (n_layers, d_model, n_heads, n_kv_heads, head_dim, vocab,
rope_theta, eps, tied, neox, head_norm) and `.tensors` / `.types` as harness.models loads them
(quantized tensors as GGUF block bytes, dequantized here). One step:
    x = embed(tokens); per layer: x += attn(rms_norm(x)); x += ffn(rms_norm(x));
    logits = rms_norm(x) @ W_out^T
with per-head RMSNorm of Q and K before RoPE for qwen3, RoPE pairs as in llama.cpp (neighbouring
for llama, NeoX for qwen3), causal GQA attention with scale 1/sqrt(head_dim), SwiGLU FFN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reference import formats
from reference.rope import rms_norm, rope


def weight32(model, name: str) -> np.ndarray:
    """A tensor as float32, dequantized from its blocks if quantized (exact: a block's scale times
    a small integer), not cached: what a decoder copies to the device once."""
    data, kind = model.tensors[name], model.types.get(name, "F32")
    if kind in formats.GGUF_BLOCK_TYPES:
        block = formats.block_weights(kind)
        return formats.dequantize(data, kind, data.shape[1] // formats.row_bytes(kind, block) * block)
    return np.asarray(data, dtype=np.float32)


def weight(model, name: str) -> np.ndarray:
    """A tensor as float64 (dequantized from its blocks if quantized); cached on the model."""
    cache = model.__dict__.setdefault("_float64", {})
    if name not in cache:
        kind = model.types.get(name, "F32")
        data = weight32(model, name) if kind in formats.GGUF_BLOCK_TYPES else model.tensors[name]
        cache[name] = np.asarray(data, dtype=np.float64)
    return cache[name]


@dataclass
class KVCache:
    """Per layer, the rotated K and the V of every position so far: [positions, n_kv, head_dim]."""

    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.k[0].shape[0] if self.k else 0


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int | None = None) -> np.ndarray:
    """Causal GQA: q [T, H, D] at positions start.., k and v [S, Hkv, D] -> [T, H * D]; with a
    window, position p sees only the last `window` positions up to p (a KV cache of `window`
    rows overwritten in a circle)."""
    t, h, d = q.shape
    group = h // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [S, H, D]
    scores = np.einsum("thd,shd->hts", q, kk) / np.sqrt(d)
    key_pos, query_pos = np.arange(k.shape[0])[None, :], (start + np.arange(t))[:, None]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = np.where(allowed[None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, vv).reshape(t, h * d)


def forward(model, tokens, cache: KVCache | None = None, window: int | None = None) -> tuple[np.ndarray, KVCache]:
    """Logits [len(tokens), vocab] for tokens at positions cache.length .., and the grown cache;
    `window`: attention over the last `window` positions only (circular overflow of a cache of
    that many rows; RoPE keeps the absolute positions)."""
    c = model.config
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence of ids")
    if tokens.min() < 0 or tokens.max() >= c.vocab:
        raise ValueError(f"token ids must be in 0..{c.vocab - 1}")
    cache = cache if cache is not None else KVCache()
    start = cache.length
    positions = np.arange(start, start + tokens.size)
    x = weight(model, "token_embd.weight")[tokens]
    for i in range(c.n_layers):
        b = f"blk.{i}."
        h = rms_norm(x, weight(model, b + "attn_norm.weight"), c.eps)
        q = (h @ weight(model, b + "attn_q.weight").T).reshape(-1, c.n_heads, c.head_dim)
        k = (h @ weight(model, b + "attn_k.weight").T).reshape(-1, c.n_kv_heads, c.head_dim)
        v = (h @ weight(model, b + "attn_v.weight").T).reshape(-1, c.n_kv_heads, c.head_dim)
        if c.head_norm:
            q = rms_norm(q, weight(model, b + "attn_q_norm.weight"), c.eps)
            k = rms_norm(k, weight(model, b + "attn_k_norm.weight"), c.eps)
        q = rope(q, positions, c.rope_theta, neox=c.neox)
        k = rope(k, positions, c.rope_theta, neox=c.neox)
        if len(cache.k) <= i:
            cache.k.append(k)
            cache.v.append(v)
        else:
            cache.k[i] = np.concatenate([cache.k[i], k])
            cache.v[i] = np.concatenate([cache.v[i], v])
        x = x + _attention(q, cache.k[i], cache.v[i], start, window) @ weight(model, b + "attn_output.weight").T
        h = rms_norm(x, weight(model, b + "ffn_norm.weight"), c.eps)
        gate, up = h @ weight(model, b + "ffn_gate.weight").T, h @ weight(model, b + "ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ weight(model, b + "ffn_down.weight").T
    x = rms_norm(x, weight(model, "output_norm.weight"), c.eps)
    out = weight(model, "token_embd.weight" if c.tied else "output.weight")
    return x @ out.T, cache
