"""vLLM's paged KV pool as lathe's kernels take it: K [blocks, Hkv, D/8, BS, 8] (a token's 8
values of a head in one 16-byte vector), V [blocks, Hkv, D, BS], blocks of BS rows. Shared by
the attention kernels that read the pool and the RoPE kernels that write it."""

from __future__ import annotations

import mlx.core as mx

BLOCK_SIZES = (16, 32)
X = 8  # fp16 values in one 16-byte K vector of the paged layout


def pool_shape(k_cache: mx.array, v_cache: mx.array) -> tuple[int, int, int, int]:
    """(blocks, Hkv, head_dim, block size) of vLLM's paged pools, checked."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, mx.array) or cache.dtype != mx.float16:
            raise ValueError(f"{name} must be float16, got {getattr(cache, 'dtype', type(cache))}")
    if k_cache.ndim != 5 or k_cache.shape[4] != X:
        raise ValueError(f"k_cache must be [blocks, Hkv, D/8, BS, 8] (the paged pool), got {tuple(k_cache.shape)}")
    blocks, n_kv, d_x, block_size, _ = k_cache.shape
    head_dim = d_x * X
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block size must be one of {BLOCK_SIZES}, got {block_size}")
    if tuple(v_cache.shape) != (blocks, n_kv, head_dim, block_size):
        raise ValueError(f"v_cache must be {(blocks, n_kv, head_dim, block_size)}, got {tuple(v_cache.shape)}")
    return blocks, n_kv, head_dim, block_size
