"""A float64 forward pass of a GGUF model: the oracle of the decode loop.

`model` is anything with `.config` and `.tensors` / `.types` as harness.program.models loads them
(quantized tensors as GGUF block bytes, dequantized here). The config says what the layer
computes (harness/arch: `config.architecture`'s norm placement, head norms, activation, fused
tensors, embedding scale; `config.layer(i)`'s window, RoPE base and scale; biases, RoPE
scalings, the attention scale and a final softcap); the step is harness/arch's docstring's:
    x = embed(tokens) [* sqrt(d)]; per layer: x += [post_norm](attn(rms_norm(x)));
    x += [post_norm](ffn(rms_norm(x))); logits = rms_norm(x) @ W_out^T [softcapped]
with RoPE pairs as in llama.cpp (neighbouring for llama, NeoX for the others), causal GQA
attention, a gated FFN (SiLU or GELU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reference import formats
from reference.rope import gelu, rms_norm, rope, rope_frequencies, silu


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


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int | None = None,
               scale: float | None = None, softcap: float = 0.0) -> np.ndarray:
    """Causal GQA: q [T, H, D] at positions start.., k and v [S, Hkv, D] -> [T, H * D], scores
    scaled by `scale` (default 1/sqrt(D)), then softcapped (c * tanh(s / c), Gemma 2's, before the
    mask as llama.cpp's build_attn); with a window, position p sees only the last `window`
    positions up to p (a sliding layer, or a KV cache of `window` rows overwritten in a circle)."""
    t, h, d = q.shape
    group = h // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [S, H, D]
    scores = np.einsum("thd,shd->hts", q, kk) * (d ** -0.5 if scale is None else scale)
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    key_pos, query_pos = np.arange(k.shape[0])[None, :], (start + np.arange(t))[:, None]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = np.where(allowed[None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, vv).reshape(t, h * d)


# llama.cpp's yarn for every architecture here: ext_factor 1, betas 32 and 1, fixed in code
# (llama-context.cpp, llama-hparams.h); the files' rope.scaling.yarn_* keys are not read by it,
# and harness.program.models refuses a file whose keys say otherwise.
YARN = dict(ext_factor=1.0, beta_fast=32.0, beta_slow=1.0)


def layer_rope(model, i: int) -> tuple[np.ndarray, float]:
    """Layer i's RoPE: each pair's angle a position and the factor on cos and sin
    (reference.rope.rope_frequencies over the config's scalings)."""
    c, layer = model.config, model.config.layer(i)
    factors = weight(model, "rope_freqs.weight") if getattr(c, "rope_freqs", False) else None
    yarn = None
    if getattr(c, "rope_scaling", "none") == "yarn":
        yarn = dict(ext_factor=YARN["ext_factor"], orig_ctx=c.rope_orig_ctx or c.ctx, beta_fast=YARN["beta_fast"],
                    beta_slow=YARN["beta_slow"])
    return rope_frequencies(c.head_dim, layer.theta, layer.freq_scale, factors, yarn,
                            getattr(c, "rope_attn_factor", 1.0))


def _linear(model, h: np.ndarray, name: str) -> np.ndarray:
    """h @ W^T, plus the matrix's bias where the file has one."""
    y = h @ weight(model, name + ".weight").T
    bias = name + ".bias"
    return y + weight(model, bias) if bias in model.tensors else y


def forward(model, tokens, cache: KVCache | None = None, window: int | None = None) -> tuple[np.ndarray, KVCache]:
    """Logits [len(tokens), vocab] for tokens at positions cache.length .., and the grown cache;
    `window`: attention over the last `window` positions only (circular overflow of a cache of
    that many rows; RoPE keeps the absolute positions), on top of a sliding layer's own window."""
    c = model.config
    a = c.architecture
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence of ids")
    if tokens.min() < 0 or tokens.max() >= c.vocab:
        raise ValueError(f"token ids must be in 0..{c.vocab - 1}")
    cache = cache if cache is not None else KVCache()
    start = cache.length
    positions = np.arange(start, start + tokens.size)
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    act = gelu if a.activation == "gelu" else silu
    x = weight(model, "token_embd.weight")[tokens]
    if a.embed_scale:
        x = x * np.sqrt(c.d_model)
    for i in range(c.n_layers):
        b = f"blk.{i}."
        h = rms_norm(x, weight(model, b + "attn_norm.weight"), c.eps)
        if a.fused_qkv:
            qkv = h @ weight(model, b + "attn_qkv.weight").T
            q, k, v = np.split(qkv, [q_rows, q_rows + kv_rows], axis=-1)
        else:
            q, k, v = (_linear(model, h, b + f"attn_{n}") for n in "qkv")
        q, k, v = (t.reshape(-1, heads, c.head_dim) for t, heads in ((q, c.n_heads), (k, c.n_kv_heads), (v, c.n_kv_heads)))
        if c.head_norm:
            q = rms_norm(q, weight(model, b + "attn_q_norm.weight"), c.eps)
            k = rms_norm(k, weight(model, b + "attn_k_norm.weight"), c.eps)
        freqs, mscale = layer_rope(model, i)
        q = rope(q, positions, neox=c.neox, freqs=freqs) * mscale
        k = rope(k, positions, neox=c.neox, freqs=freqs) * mscale
        if len(cache.k) <= i:
            cache.k.append(k)
            cache.v.append(v)
        else:
            cache.k[i] = np.concatenate([cache.k[i], k])
            cache.v[i] = np.concatenate([cache.v[i], v])
        sees = [w for w in (window, c.layer(i).window) if w]
        o = _attention(q, cache.k[i], cache.v[i], start, min(sees) if sees else None, c.scale,
                       getattr(c, "attn_softcap", 0.0))
        o = _linear(model, o, b + "attn_output")
        if a.post_norms:
            o = rms_norm(o, weight(model, b + "post_attention_norm.weight"), c.eps)
        x = x + o
        h = rms_norm(x, weight(model, b + "ffn_norm.weight"), c.eps)
        if a.fused_gate_up:
            gate, up = np.split(h @ weight(model, b + "ffn_up.weight").T, 2, axis=-1)
        else:
            gate, up = h @ weight(model, b + "ffn_gate.weight").T, h @ weight(model, b + "ffn_up.weight").T
        f = (act(gate) * up) @ weight(model, b + "ffn_down.weight").T
        if a.post_norms:
            f = rms_norm(f, weight(model, b + "post_ffw_norm.weight"), c.eps)
        x = x + f
    x = rms_norm(x, weight(model, "output_norm.weight"), c.eps)
    logits = x @ weight(model, "token_embd.weight" if c.tied else "output.weight").T
    if getattr(c, "final_softcap", 0.0):
        logits = c.final_softcap * np.tanh(logits / c.final_softcap)
    return logits, cache
