"""Decode attention and its KV caches, in float64.

One query token per sequence attends to the sequence's cached keys and values:
``out[h] = softmax(scale * q[h] . k[t, h // G]) . v[t, h // G]`` over its tokens t, with
G = n_heads / n_kv_heads query heads per KV head (grouped-query attention).

Caches (the layouts the kernels read):
- contiguous, head-major: ``cache[batch, n_kv_heads, max_seq, head_dim]``; token position p sits
  in slot p % max_seq (circular overflow: once more than max_seq tokens were written, the last
  max_seq are what attention sees; decode attention does not depend on their order);
- paged, as vLLM: a pool of blocks of `block_size` tokens; K is
  ``[num_blocks, n_kv_heads, head_dim / x, block_size, x]`` (x = 8 fp16 values, 16 bytes) and V
  ``[num_blocks, n_kv_heads, head_dim, block_size]``; token t of sequence b is in block
  ``block_table[b, t // block_size]`` at offset ``t % block_size``.
The readers here gather each token by its own block and offset, as the definition says.
"""

from __future__ import annotations

import numpy as np

X = 8  # fp16 values in one 16-byte K vector of the paged layout


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softcap: float = 0.0) -> np.ndarray:
    """q [n_heads, D], k and v [tokens, n_kv_heads, D] -> [n_heads, D] (float64). Query head h
    reads KV head h // G: the heads are grouped [n_kv_heads, G] and each group is one product.
    `softcap` (> 0, Gemma 2): each scaled score s becomes c * tanh(s / c) before the softmax."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    n_heads, n_kv = q.shape[0], k.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}")
    qg = q.reshape(n_kv, n_heads // n_kv, -1)  # [Hkv, G, D]
    s = scale * (qg @ k.transpose(1, 2, 0))  # [Hkv, G, tokens]
    if softcap:
        s = softcap * np.tanh(s / softcap)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out = (p / p.sum(axis=-1, keepdims=True)) @ v.transpose(1, 0, 2)  # [Hkv, G, D]
    return out.reshape(n_heads, -1)


def paged_tokens(k_cache: np.ndarray, v_cache: np.ndarray, block_row: np.ndarray,
                 context: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `context` tokens of one sequence out of the paged caches: k, v [context, Hkv, D]."""
    _, n_kv, d_x, block_size, x = k_cache.shape
    t = np.arange(context)
    blocks, offsets = np.asarray(block_row)[t // block_size].astype(np.int64), t % block_size
    # token t is at [block, :, :, offset, :] (K) and [block, :, :, offset] (V); the gathered axis
    # comes first: k [context, n_kv, D / x, x], v [context, n_kv, D]
    k = k_cache[blocks, :, :, offsets, :].reshape(context, n_kv, d_x * x)
    v = v_cache[blocks, :, :, offsets]
    return k.astype(np.float64), v.astype(np.float64)


def contiguous_tokens(k_cache: np.ndarray, v_cache: np.ndarray, b: int,
                      written: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens attention sees in sequence b of a head-major cache after `written` tokens:
    positions max(0, written - max_seq) .. written - 1, each from slot position % max_seq."""
    max_seq = k_cache.shape[2]
    positions = np.arange(max(0, written - max_seq), written)
    slots = positions % max_seq
    return (np.transpose(k_cache[b][:, slots, :], (1, 0, 2)),
            np.transpose(v_cache[b][:, slots, :], (1, 0, 2)))


def reshape_and_cache(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                      slots: np.ndarray) -> None:
    """Write tokens' k, v [T, Hkv, D] into the paged caches at slot numbers (block * block_size
    + offset); a negative slot is skipped (a padding token). In place. Slots must be distinct
    (one sequence's tokens each have their own)."""
    block_size, x = k_cache.shape[3], k_cache.shape[4]
    slots = np.asarray(slots).astype(np.int64)
    keep = slots >= 0
    if len(np.unique(slots[keep])) != int(keep.sum()):
        raise ValueError("two tokens were given one slot")
    blocks, offs = slots[keep] // block_size, slots[keep] % block_size
    # token t goes to [block, :, :, off, :] (K) and [block, :, :, off] (V): the indexed axes come
    # first in the assigned values, [T, Hkv, D / x, x] and [T, Hkv, D]
    k_cache[blocks, :, :, offs, :] = np.asarray(k)[keep].reshape(len(blocks), k.shape[1], -1, x)
    v_cache[blocks, :, :, offs] = np.asarray(v)[keep]
