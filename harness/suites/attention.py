"""The decode attention family: paged attention v1 and v2, flash decode (split and whole) over
the contiguous cache with circular overflow, and reshape_and_cache, against reference/attention.py
(float64, walking the block tables token by token). Unused cache slots and blocks hold NaN, so a
read past a context fails the comparison."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from harness.check import CheckCase, Comparison, compare, exact
from reference import attention as ref, rel_err

TOL = 2e-3
CONTEXTS = (1, 15, 16, 17, 511, 512, 513, 4096, 32768)
HEADS = ((32, 32), (32, 8), (16, 8), (64, 8))


def _paged_state(rng: np.random.Generator, lens: list[int], n_kv: int, head_dim: int,
                 block_size: int):
    """NaN-filled pools with each sequence's tokens in blocks scattered over the pool (a few
    spare blocks never referenced), and the block table."""
    need = [-(-n // block_size) for n in lens]
    blocks = sum(need) + 3
    k_pool = np.full((blocks, n_kv, head_dim // ref.X, block_size, ref.X), np.nan, np.float16)
    v_pool = np.full((blocks, n_kv, head_dim, block_size), np.nan, np.float16)
    order = rng.permutation(blocks)
    table = np.zeros((len(lens), max(need)), np.int32)
    at = 0
    for b, n in enumerate(lens):
        table[b, : need[b]] = order[at: at + need[b]]
        at += need[b]
        k = rng.standard_normal((n, n_kv, head_dim), dtype=np.float32).astype(np.float16)
        v = rng.standard_normal((n, n_kv, head_dim), dtype=np.float32).astype(np.float16)
        slots = table[b, np.arange(n) // block_size] * block_size + np.arange(n) % block_size
        ref.reshape_and_cache(k_pool, v_pool, k, v, slots)
    return k_pool, v_pool, table


def _paged_case(version: str, lens: list[int], heads: tuple[int, int], head_dim: int,
                block_size: int, opts: dict | None = None) -> CheckCase:
    """`opts`: kernels.options set around the launch (named in the case's variant)."""
    from kernels import options
    from kernels.attention import paged_attention
    from kernels.runtime import poisoned_outputs

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        k_pool, v_pool, table = _paged_state(rng, lens, n_kv, head_dim, block_size)
        q = rng.standard_normal((len(lens), n_heads, head_dim)).astype(np.float16)
        scale = head_dim ** -0.5
        with poisoned_outputs(), options.use(**(opts or {})):
            out = paged_attention(mx.array(q), mx.array(k_pool), mx.array(v_pool), table, lens,
                                  scale, version=version, split_from=0)
            mx.eval(out)
        out = np.array(out)
        checks = []
        for b, n in enumerate(lens):
            k, v = ref.paged_tokens(k_pool, v_pool, table[b], n)
            checks.append(compare(f"sequence {b} ({n} tokens)", out[b], ref.attend(q[b], k, v, scale), TOL))
        return checks

    shape = dict(ctx="/".join(map(str, lens)), heads=f"{n_heads}/{n_kv}", D=head_dim, bs=block_size)
    return CheckCase("attention", "paged_attention", version + _named(opts), shape, run)


def _named(opts: dict | None) -> str:
    return "".join(f", {k}={v}" for k, v in (opts or {}).items())


def _contiguous_case(split: bool, lens: list[int], heads: tuple[int, int], head_dim: int,
                     max_seq: int, written: list[int] | None = None, opts: dict | None = None,
                     window: int = 0, softcap: float = 0.0) -> CheckCase:
    """flash_decode over [B, Hkv, max_seq, D]; `written` past max_seq tests circular overflow
    (the cache then holds the last max_seq tokens, slot = position % max_seq). `opts`:
    kernels.options set around the launch. `window`: a sliding-window layer's, each sequence
    over its last `window` tokens (the rows before them hold other tokens: wrong if read)."""
    from kernels import options
    from kernels.attention import flash_decode, visible_tokens
    from kernels.runtime import poisoned_outputs

    n_heads, n_kv = heads
    written = written or lens

    def run(rng: np.random.Generator) -> list[Comparison]:
        batch = len(written)
        kc = np.full((batch, n_kv, max_seq, head_dim), np.nan, np.float16)
        vc = np.full_like(kc, np.nan)
        for b, n in enumerate(written):  # token p in slot p % max_seq: the last max_seq survive
            slots = np.arange(max(0, n - max_seq), n) % max_seq
            kc[b][:, slots] = rng.standard_normal((n_kv, len(slots), head_dim), dtype=np.float32)
            vc[b][:, slots] = rng.standard_normal((n_kv, len(slots), head_dim), dtype=np.float32)
        q = rng.standard_normal((batch, n_heads, head_dim)).astype(np.float16)
        scale = head_dim ** -0.5
        seen = [visible_tokens(n, max_seq) for n in written]
        with poisoned_outputs(), options.use(**(opts or {})):
            out = flash_decode(mx.array(q), mx.array(kc), mx.array(vc), seen, scale, split=split,
                              split_from=0, window=window, softcap=softcap)
            mx.eval(out)
        out = np.array(out)
        checks = []
        for b, n in enumerate(written):
            k, v = ref.contiguous_tokens(kc, vc, b, n)
            if window:
                k, v = k[-window:], v[-window:]
            checks.append(compare(f"sequence {b} ({n} written)", out[b], ref.attend(q[b], k, v, scale, softcap), TOL))
        return checks

    shape = dict(ctx="/".join(map(str, written)), heads=f"{n_heads}/{n_kv}", D=head_dim, max_seq=max_seq)
    if window:
        shape["window"] = window
    if softcap:
        shape["softcap"] = softcap
    return CheckCase("attention", "flash_decode", ("split" if split else "whole") + _named(opts), shape, run)


def _reshape_case(tokens: int, n_kv: int, head_dim: int, block_size: int) -> CheckCase:
    """reshape_and_cache into NaN pools (a padding slot included), bit for bit against the
    reference; then paged attention over the written caches in the same graph, ordered by the
    token (DESIGN.md), against float64."""
    from kernels.attention import paged_attention, reshape_and_cache

    def run(rng: np.random.Generator) -> list[Comparison]:
        blocks = -(-tokens // block_size) + 2
        k_pool = np.full((blocks, n_kv, head_dim // ref.X, block_size, ref.X), np.nan, np.float16)
        v_pool = np.full((blocks, n_kv, head_dim, block_size), np.nan, np.float16)
        table = rng.permutation(blocks)[: -(-tokens // block_size)].astype(np.int32)
        slots = table[np.arange(tokens) // block_size] * block_size + np.arange(tokens) % block_size
        k = rng.standard_normal((tokens, n_kv, head_dim)).astype(np.float16)
        v = rng.standard_normal((tokens, n_kv, head_dim)).astype(np.float16)
        with_pad = np.concatenate([slots, [-1]]).astype(np.int32)
        k_pad = np.concatenate([k, np.ones((1, n_kv, head_dim), np.float16)])
        v_pad = np.concatenate([v, np.ones((1, n_kv, head_dim), np.float16)])
        kc, vc, written = reshape_and_cache(mx.array(k_pad), mx.array(v_pad), mx.array(k_pool),
                                            mx.array(v_pool), with_pad)
        q = rng.standard_normal((1, n_kv * 4, head_dim)).astype(np.float16)
        out = paged_attention(mx.array(q), kc, vc, table[None], [tokens], head_dim ** -0.5,
                              after=written)
        mx.eval(kc, vc, out)
        ref.reshape_and_cache(k_pool, v_pool, k_pad, v_pad, with_pad)
        bits = lambda a: np.asarray(a).view(np.uint16)  # noqa: E731 - NaN slots compared as bits
        kk, vv = ref.paged_tokens(k_pool, v_pool, table, tokens)
        return [exact("k_cache bits", bits(np.array(kc)), bits(k_pool)),
                exact("v_cache bits", bits(np.array(vc)), bits(v_pool)),
                compare("attention after the write", np.array(out)[0],
                        ref.attend(q[0], kk, vv, head_dim ** -0.5), TOL)]

    return CheckCase("attention", "reshape_and_cache", "in place",
                     dict(T=tokens, Hkv=n_kv, D=head_dim, bs=block_size), run)


def _prefill_case(tokens: int, pos: int, heads: tuple[int, int], head_dim: int, kernel: str,
                  block_size: int = 0, window: int = 0, softcap: float = 0.0) -> CheckCase:
    """A prompt of `tokens` at positions pos.. over a cache already holding pos earlier tokens:
    query i against rows 0 .. pos+i only (rows past pos+tokens are NaN). With a block size, the
    same tokens in a paged pool, blocks scattered by the table (spare blocks NaN). kernel:
    "tiled", "wgmma" (Hopper only), or the decode kernel "split" (forced) or "whole"."""
    from kernels.attention import prefill_attention
    from kernels.runtime import poisoned_outputs

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        max_seq = pos + tokens + 5
        kc = np.full((n_kv, max_seq, head_dim), np.nan, np.float16)
        vc = np.full_like(kc, np.nan)
        kc[:, : pos + tokens] = rng.standard_normal((n_kv, pos + tokens, head_dim))
        vc[:, : pos + tokens] = rng.standard_normal((n_kv, pos + tokens, head_dim))
        q = rng.standard_normal((tokens, n_heads, head_dim)).astype(np.float16)
        scale = head_dim ** -0.5
        k_all, v_all = kc.transpose(1, 0, 2), vc.transpose(1, 0, 2)  # [tokens, Hkv, D]
        k64, v64 = k_all.astype(np.float64), v_all.astype(np.float64)  # once, not per query
        caches, table = (mx.array(kc), mx.array(vc)), None
        if block_size:
            need = -(-max_seq // block_size)
            blocks = need + 3
            k_pool = np.full((blocks, n_kv, head_dim // ref.X, block_size, ref.X), np.nan, np.float16)
            v_pool = np.full((blocks, n_kv, head_dim, block_size), np.nan, np.float16)
            table = rng.permutation(blocks)[:need].astype(np.int32)
            n = pos + tokens
            slots = table[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
            ref.reshape_and_cache(k_pool, v_pool, k_all[:n], v_all[:n], slots)
            caches = (mx.array(k_pool), mx.array(v_pool))
        with poisoned_outputs():
            out = prefill_attention(mx.array(q), *caches, pos, scale, block_table=table,
                                    kernel=kernel if kernel in ("tiled", "wgmma") else "decode",
                                    split=kernel == "split", split_from=0, window=window, softcap=softcap)
            mx.eval(out)
        out = np.array(out)
        first = lambda i: max(0, pos + i + 1 - window) if window else 0  # noqa: E731
        want = np.stack([ref.attend(q[i], k64[first(i): pos + i + 1], v64[first(i): pos + i + 1], scale, softcap)
                         for i in range(tokens)])
        return [compare("causal outputs" + (f" (window {window})" if window else ""), out, want, TOL)]

    shape = dict(T=tokens, pos=pos, heads=f"{n_heads}/{n_kv}", D=head_dim)
    if block_size:
        shape["bs"] = block_size
    if window:
        shape["window"] = window
    if softcap:
        shape["softcap"] = softcap
    variant = kernel + (" paged" if block_size else "")
    return CheckCase("attention", "prefill_attention", variant, shape, run)


def _merge_case(lens: list[int], heads: tuple[int, int], head_dim: int, combine: str,
                opts: dict | None = None) -> CheckCase:
    """Split flash_decode with the partitions merged in its own launch (last_group: on counters
    given, twice on the same counters, which each launch must leave zero) or by the combine
    launch, against float64."""
    from kernels import options
    from kernels.attention import flash_decode, merge_counters
    from kernels.runtime import poisoned_outputs

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        batch, max_seq = len(lens), max(lens)
        checks = []
        counters = merge_counters(batch * n_heads)
        for launch_ in (1, 2):
            kc = rng.standard_normal((batch, n_kv, max_seq, head_dim)).astype(np.float16)
            vc = rng.standard_normal((batch, n_kv, max_seq, head_dim)).astype(np.float16)
            for b, n in enumerate(lens):
                kc[b, :, n:], vc[b, :, n:] = np.nan, np.nan
            q = rng.standard_normal((batch, n_heads, head_dim)).astype(np.float16)
            scale = head_dim ** -0.5
            with poisoned_outputs(), options.use(attn_combine=combine, **(opts or {})):
                out = flash_decode(mx.array(q), mx.array(kc), mx.array(vc), lens, scale, split_from=0,
                                   counters=counters)
                mx.eval(out, counters)
            out = np.array(out)
            for b, n in enumerate(lens):
                k, v = ref.contiguous_tokens(kc, vc, b, n)
                checks.append(compare(f"launch {launch_}, sequence {b} ({n} tokens)", out[b],
                                      ref.attend(q[b], k, v, scale), TOL))
            checks.append(exact(f"counters left zero (launch {launch_})", int(np.array(counters).sum()), 0))
        return checks

    shape = dict(ctx="/".join(map(str, lens)), heads=f"{n_heads}/{n_kv}", D=head_dim)
    return CheckCase("attention", "flash_decode", f"split, merged: {combine}" + _named(opts), shape, run)


def _rope_decode_case(pos: int, heads: tuple[int, int], head_dim: int, neox: bool, split: bool,
                      device_pos: bool = False, head_norm: bool = False, opts: dict | None = None) -> CheckCase:
    """rope_flash_decode: one token's QKV row at `pos` over a cache holding rows 0..pos-1 (row
    pos and later NaN: the kernel must write row pos before it reads it), against float64 RoPE
    (reference/rope.py) and attention; the new cache rows against the rotated K and V, every
    other row unchanged, NaN included. `device_pos`: the position as int32[1] on the device (a
    compiled step's form)."""
    from kernels import options
    from kernels.attention import rope_flash_decode
    from kernels.runtime import poisoned_outputs
    from reference import rope as ref_rope

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        max_seq = pos + 9
        kc = np.full((n_kv, max_seq, head_dim), np.nan, np.float16)
        vc = np.full_like(kc, np.nan)
        kc[:, :pos] = rng.standard_normal((n_kv, pos, head_dim))
        vc[:, :pos] = rng.standard_normal((n_kv, pos, head_dim))
        qkv = rng.standard_normal((n_heads + 2 * n_kv) * head_dim).astype(np.float16)
        q, k, v = np.split(qkv, [n_heads * head_dim, (n_heads + n_kv) * head_dim])
        theta, scale = 500000.0, head_dim ** -0.5
        at = mx.array(np.array([pos], np.int32)) if device_pos else pos
        norms = [rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2)] if head_norm else [None, None]
        with poisoned_outputs(), options.use(**(opts or {})):
            out, k_new, v_new = rope_flash_decode(mx.array(qkv), mx.array(kc), mx.array(vc), at, scale,
                                                  n_heads=n_heads, theta=theta, neox=neox, split=split,
                                                  split_from=0, eps=1e-6 if head_norm else None,
                                                  **{n: mx.array(w) for n, w in zip(("q_norm", "k_norm"), norms)
                                                     if w is not None})
            mx.eval(out, k_new, v_new)
        q_rot, k_want, v_want = ref_rope.rope_kv_write(
            q.reshape(1, n_heads, head_dim), k.reshape(1, n_kv, head_dim), v.reshape(1, n_kv, head_dim),
            kc, vc, pos, theta=theta, neox=neox, q_norm=norms[0], k_norm=norms[1], eps=1e-6)
        k_got, v_got = np.array(k_new), np.array(v_new)
        others = np.arange(max_seq) != pos
        checks = [compare("K row pos (rotated)", k_got[:, pos], k_want[:, pos], 1e-3),
                  exact("V row pos", v_got[:, pos], v_want[:, pos].astype(np.float16)),
                  # bit patterns: NaN rows must stay the same NaN
                  exact("K other rows untouched", k_got[:, others].view(np.uint16), kc[:, others].view(np.uint16)),
                  exact("V other rows untouched", v_got[:, others].view(np.uint16), vc[:, others].view(np.uint16))]
        keys = k_want[:, : pos + 1].transpose(1, 0, 2)
        values = v_want[:, : pos + 1].transpose(1, 0, 2)
        checks.append(compare("attention output", np.array(out)[0], ref.attend(q_rot[0], keys, values, scale), TOL))
        return checks

    shape = dict(pos=pos, heads=f"{n_heads}/{n_kv}", D=head_dim)
    variant = (("head-norm " if head_norm else "") + ("neox " if neox else "") + ("split" if split else "whole")
               + (" device pos" if device_pos else "") + _named(opts))
    return CheckCase("attention", "rope_flash_decode", variant, shape, run)


def _rope_prefill_case(tokens: int, pos: int, heads: tuple[int, int], head_dim: int, neox: bool,
                       head_norm: bool = False) -> CheckCase:
    """rope_prefill_attention: a prompt's QKV rows at positions pos.. over a cache holding rows
    0..pos-1 (the prompt's rows and past them NaN: each CTA writes its kv head's rows before it
    copies them), against float64 (head norms,) RoPE (reference/rope.py) and causal attention;
    the new cache rows against the rotated K and V, every other row unchanged bit for bit."""
    from kernels.attention import rope_prefill_attention
    from kernels.runtime import poisoned_outputs
    from reference import rope as ref_rope

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        max_seq = pos + tokens + 9
        kc = np.full((n_kv, max_seq, head_dim), np.nan, np.float16)
        vc = np.full_like(kc, np.nan)
        kc[:, :pos] = rng.standard_normal((n_kv, pos, head_dim))
        vc[:, :pos] = rng.standard_normal((n_kv, pos, head_dim))
        qkv = rng.standard_normal((tokens, (n_heads + 2 * n_kv) * head_dim)).astype(np.float16)
        q, k, v = np.split(qkv, [n_heads * head_dim, (n_heads + n_kv) * head_dim], axis=1)
        theta, scale = 1000000.0, head_dim ** -0.5
        norms = [rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2)] if head_norm else [None, None]
        with poisoned_outputs():
            out, k_new, v_new = rope_prefill_attention(
                mx.array(qkv), mx.array(kc), mx.array(vc), pos, scale, n_heads=n_heads, theta=theta, neox=neox,
                eps=1e-6 if head_norm else None,
                **{n: mx.array(w) for n, w in zip(("q_norm", "k_norm"), norms) if w is not None})
            mx.eval(out, k_new, v_new)
        q_rot, k_want, v_want = ref_rope.rope_kv_write(
            q.reshape(tokens, n_heads, head_dim), k.reshape(tokens, n_kv, head_dim),
            v.reshape(tokens, n_kv, head_dim), kc, vc, pos, theta=theta, neox=neox, q_norm=norms[0],
            k_norm=norms[1], eps=1e-6)
        k_got, v_got = np.array(k_new), np.array(v_new)
        new = slice(pos, pos + tokens)
        others = (np.arange(max_seq) < pos) | (np.arange(max_seq) >= pos + tokens)
        checks = [compare("K rows pos.. (rotated)", k_got[:, new], k_want[:, new], 1e-3),
                  exact("V rows pos..", v_got[:, new], v_want[:, new].astype(np.float16)),
                  exact("K other rows untouched", k_got[:, others].view(np.uint16), kc[:, others].view(np.uint16)),
                  exact("V other rows untouched", v_got[:, others].view(np.uint16), vc[:, others].view(np.uint16))]
        keys = k_want.transpose(1, 0, 2).astype(np.float64)  # [max_seq, Hkv, D]
        values = v_want.transpose(1, 0, 2).astype(np.float64)
        want = np.stack([ref.attend(q_rot[i], keys[: pos + i + 1], values[: pos + i + 1], scale)
                         for i in range(tokens)])
        checks.append(compare("causal outputs", np.array(out), want, TOL))
        return checks

    shape = dict(T=tokens, pos=pos, heads=f"{n_heads}/{n_kv}", D=head_dim)
    variant = ("head-norm " if head_norm else "") + ("neox" if neox else "adjacent pairs")
    return CheckCase("attention", "rope_prefill_attention", variant, shape, run)


def _paged_rope_case(lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int, neox: bool,
                     device_ids: bool, head_norm: bool = False, opts: dict | None = None) -> CheckCase:
    """paged_rope_attention: sequence b's new token at position lens[b] - 1, its QKV row one of a
    batch's, over a pool holding its tokens before (the new token's slot NaN: written before it is
    read), against float64 RoPE and attention; the new K and V at their slots, every other slot
    of the pool unchanged bit for bit. `device_ids`: positions and table as device arrays (a
    compiled step's form); split_from 0, so contexts past a partition take the split launch."""
    from kernels import options
    from kernels.attention import paged_rope_attention
    from kernels.runtime import poisoned_outputs
    from reference import rope as ref_rope

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        k_pool, v_pool, table = _paged_state(rng, lens, n_kv, head_dim, block_size)
        positions = np.asarray(lens, np.int32) - 1
        slots = table[np.arange(len(lens)), positions // block_size] * block_size + positions % block_size
        k_pool[slots // block_size, :, :, slots % block_size, :] = np.nan  # the new tokens' slots
        v_pool[slots // block_size, :, :, slots % block_size] = np.nan
        # the pools as rows [blocks * BS, Hkv, D], row = slot
        k_rows = k_pool.transpose(0, 3, 1, 2, 4).reshape(-1, n_kv, head_dim)
        v_rows = v_pool.transpose(0, 3, 1, 2).reshape(-1, n_kv, head_dim)
        qkv = rng.standard_normal((len(lens), (n_heads + 2 * n_kv) * head_dim)).astype(np.float16)
        theta, scale = 1000000.0, head_dim ** -0.5
        norms = [rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2)] if head_norm else [None, None]
        ids = (mx.array(table), mx.array(positions)) if device_ids else (table, positions)
        with poisoned_outputs(), options.use(**(opts or {})):
            out, k_new, v_new = paged_rope_attention(
                mx.array(qkv), mx.array(k_pool), mx.array(v_pool), *ids, scale, n_heads=n_heads, theta=theta,
                neox=neox, split_from=0, eps=1e-6 if head_norm else None,
                **{n: mx.array(w) for n, w in zip(("q_norm", "k_norm"), norms) if w is not None})
            mx.eval(out, k_new, v_new)
        k_got = np.array(k_new).transpose(0, 3, 1, 2, 4).reshape(-1, n_kv, head_dim)
        v_got = np.array(v_new).transpose(0, 3, 1, 2).reshape(-1, n_kv, head_dim)
        others = np.setdiff1d(np.arange(k_got.shape[0]), slots)
        checks = [exact("K other slots untouched", k_got[others].view(np.uint16), k_rows[others].view(np.uint16)),
                  exact("V other slots untouched", v_got[others].view(np.uint16), v_rows[others].view(np.uint16))]
        out = np.array(out)
        for b, n in enumerate(lens):
            q, k, v = np.split(qkv[b], [n_heads * head_dim, (n_heads + n_kv) * head_dim])
            room_k, room_v = (np.zeros((n_kv, n, head_dim), np.float16) for _ in range(2))
            q_rot, k_want, v_want = ref_rope.rope_kv_write(
                q.reshape(1, n_heads, head_dim), k.reshape(1, n_kv, head_dim), v.reshape(1, n_kv, head_dim),
                room_k, room_v, n - 1, theta=theta, neox=neox, q_norm=norms[0], k_norm=norms[1], eps=1e-6)
            checks += [compare(f"sequence {b}: K at its slot (rotated)", k_got[slots[b]], k_want[:, n - 1], 1e-3),
                       exact(f"sequence {b}: V at its slot", v_got[slots[b]], v_want[:, n - 1].astype(np.float16))]
            keys, values = ref.paged_tokens(k_pool, v_pool, table[b], n - 1)
            keys = np.concatenate([keys, k_want[:, n - 1][None]])
            values = np.concatenate([values, v_want[:, n - 1][None]])
            checks.append(compare(f"sequence {b} ({n} tokens)", out[b], ref.attend(q_rot[0], keys, values, scale), TOL))
        return checks

    shape = dict(ctx="/".join(map(str, lens)), heads=f"{n_heads}/{n_kv}", D=head_dim, bs=block_size)
    variant = (("head-norm " if head_norm else "") + ("neox" if neox else "pairs")
               + (", device ids" if device_ids else "") + _named(opts))
    return CheckCase("attention", "paged_rope_attention", variant, shape, run)


def check_cases(small: bool = False) -> list[CheckCase]:
    from kernels import native

    contexts = (1, 17, 513) if small else CONTEXTS
    cases = []
    for c, ctx in enumerate(contexts):
        heads = HEADS[c % len(HEADS)]
        head_dim = (128, 64, 256)[c % 3] if ctx <= 4096 else 128
        bs = (16, 32)[c % 2]
        for version in ("v1", "v2"):
            cases.append(_paged_case(version, [ctx], heads, head_dim, bs))
        for split in (True, False):
            cases.append(_contiguous_case(split, [ctx], heads, head_dim, max(ctx, 16)))
    # several sequences of different lengths in one launch
    for version in ("v1", "v2"):
        cases.append(_paged_case(version, [513, 17, 1, 1100], (32, 8), 128, 16))
    cases.append(_contiguous_case(True, [700, 3, 1025], (32, 8), 128, 1100))
    # circular overflow: more written than the cache holds
    cases.append(_contiguous_case(True, [], (16, 8), 128, 512, written=[1300, 512, 700]))
    # a prompt (the decode kernel a query per token, split and whole; the tiled kernel, whose
    # tiles are 64 query rows (32 at D = 256) and 32 keys (16): tails on both sides)
    prompts = ((1, 0, (32, 8), 128), (17, 0, (32, 8), 128), (64, 100, (16, 8), 64),
               (513, 7, (32, 32), 128), (200, 1000, (64, 8), 256))
    for tokens, pos, heads, d in prompts:
        if small and tokens > 17:
            continue
        for kernel in ("tiled", "split", "whole"):
            cases.append(_prefill_case(tokens, pos, heads, d, kernel))
    for tokens, pos, heads, d in ((65, 0, (32, 8), 128), (130, 31, (16, 8), 64), (97, 33, (8, 8), 256),
                                  (300, 2000, (16, 8), 128)):
        if not small:
            cases.append(_prefill_case(tokens, pos, heads, d, "tiled"))
    # sliding-window layers (Gemma's): a decode token past its window, at a split's edge and
    # unaligned starts; prompts whose rows see windows inside, across and before their tiles
    for ctx, window, heads, d, split in ((1300, 512, (4, 1), 256, True), (700, 100, (32, 8), 128, True),
                                         (37, 8, (16, 8), 64, False), (513, 512, (4, 1), 256, False),
                                         (5000, 1021, (8, 8), 128, True)):
        if not (small and ctx > 700):
            cases.append(_contiguous_case(split, [ctx], heads, d, ctx + 3, window=window))
    for tokens, pos, heads, d, window in ((200, 0, (4, 1), 256, 64), (97, 600, (4, 1), 256, 512),
                                          (300, 31, (16, 8), 128, 40), (17, 0, (32, 8), 128, 5)):
        if small and tokens > 17:
            continue
        for kernel in ("tiled", "split"):
            cases.append(_prefill_case(tokens, pos, heads, d, kernel, window=window))
    # Gemma 2's softcap of the scores (random scores of a few units: a cap of 2 bites), with and
    # without a window, on the decode kernel (MMA-sized heads and not) and the tiled prefill
    for ctx, window, heads, d, split in ((700, 0, (8, 4), 256, True), (37, 8, (16, 8), 64, False),
                                         (3000, 100, (32, 8), 128, True)):
        if not (small and ctx > 700):
            cases.append(_contiguous_case(split, [ctx], heads, d, ctx + 3, window=window, softcap=2.0))
    for tokens, pos, heads, d, window in ((97, 30, (8, 4), 256, 0), (130, 5, (16, 8), 64, 40)):
        if not (small and tokens > 17):
            cases += [_prefill_case(tokens, pos, heads, d, kernel, window=window, softcap=2.0) for kernel in ("tiled", "split")]
    # Phi-3-mini's heads of 96 (32 of them, no GQA): K in rounds of 6 vectors, the contiguous V a
    # half a load (decode_tiles.metal's V_PAIRS); the paged layouts, the tiled prompt, RoPE inside
    for ctx, split in ((17, False), (700, True)):
        cases.append(_contiguous_case(split, [ctx], (32, 32), 96, ctx + 3))
    cases += [_paged_case(version, [513, 17], (32, 32), 96, 16) for version in ("v1", "v2")]
    cases += [_prefill_case(130, 5, (32, 32), 96, kernel) for kernel in ("tiled", "split")]
    cases.append(_prefill_case(17, 0, (32, 32), 96, "tiled", 16))
    cases.append(_rope_decode_case(40, (32, 32), 96, True, True, True))
    # a prompt over the paged pool (the decode loop's paged option)
    for tokens, pos, heads, d, bs in ((17, 0, (32, 8), 128, 16), (64, 100, (16, 8), 64, 32),
                                      (200, 1000, (64, 8), 256, 16), (130, 5, (32, 8), 128, 32)):
        if small and tokens > 17:
            continue
        for kernel in ("tiled", "split"):
            cases.append(_prefill_case(tokens, pos, heads, d, kernel, bs))
    # the wgmma prompt kernel (a native CUDA kernel: Hopper only), tiles of 128 rows and 128 keys:
    # tails on both sides, positions past a tile, GQA 4:1, 2:1 and 1:1, both head dims it takes
    if native.available():
        for tokens, pos, heads, d, bs in ((1, 0, (32, 8), 128, 0), (17, 0, (32, 8), 128, 0),
                                          (130, 31, (16, 8), 64, 0), (129, 127, (32, 8), 128, 0),
                                          (513, 7, (32, 32), 128, 0), (300, 2000, (16, 8), 128, 0),
                                          (17, 0, (32, 8), 128, 16), (64, 100, (16, 8), 64, 32),
                                          (130, 5, (32, 8), 128, 32), (300, 700, (32, 8), 128, 16),
                                          (260, 3, (16, 8), 64, 16)):
            if small and tokens > 17:
                continue
            cases.append(_prefill_case(tokens, pos, heads, d, "wgmma", bs))
    # a short prompt's (head norms,) RoPE + KV write + attention in one wgmma launch: one query
    # tile, tails, a prompt at depth, both pair forms, GQA 4:1 to 1:1, Qwen3's and the 8B's heads
    if native.available():
        for tokens, pos, heads, d, neox, norm in ((16, 0, (16, 8), 128, True, True), (1, 0, (16, 8), 128, True, True),
                                                  (128, 0, (16, 8), 128, True, True), (37, 300, (16, 8), 128, True, True),
                                                  (64, 0, (32, 8), 128, False, False),
                                                  (17, 130, (32, 8), 128, False, False),
                                                  (100, 5, (8, 2), 64, True, True), (33, 0, (12, 12), 64, False, False)):
            cases.append(_rope_prefill_case(tokens, pos, heads, d, neox, norm))
    # RoPE + KV write + attention in one launch (the fused decode loop's attention)
    for pos, heads, d, neox, split, dev in ((0, (32, 8), 128, False, False, False), (16, (32, 8), 128, False, True, True),
                                            (70, (16, 16), 64, True, False, True), (600, (64, 8), 256, True, True, False),
                                            (1500, (32, 8), 128, False, True, False)):
        if small and pos > 16:
            continue
        cases.append(_rope_decode_case(pos, heads, d, neox, split, dev))
    # ... with Qwen3's head norms in the same launch
    for pos, heads, d, split, dev in ((5, (16, 8), 128, False, True), (900, (16, 8), 128, True, False),
                                      (40, (8, 2), 64, True, False)):
        if small and pos > 16:
            continue
        cases.append(_rope_decode_case(pos, heads, d, True, split, dev, head_norm=True))
    # query heads a kv head that no power of two divides (Qwen2.5-7B's 7, Qwen2.5-1.5B's 6): QS is
    # any divisor of the group, a threadgroup one or a few of the heads
    for ctx, heads, split in ((17, (28, 4), False), (700, (28, 4), True), (513, (12, 2), True)):
        if not (small and ctx > 17):
            cases.append(_contiguous_case(split, [ctx], heads, 128, ctx + 3))
    if not small:
        cases.append(_paged_case("v2", [513, 17], (28, 4), 128, 16))
        cases.append(_rope_decode_case(900, (12, 2), 128, True, True, False))
    cases.append(_rope_decode_case(40, (28, 4), 128, True, False, True))
    # the partitions merged in the launch (the default) and by a combine launch; sequences ending
    # in a partition's first token, and partitions past a shorter sequence's end (empty)
    for lens, heads, d in (([4097], (32, 8), 128), ([129, 1200, 3], (16, 8), 64), ([700], (8, 8), 256)):
        if small and max(lens) > 1000:
            continue
        for combine in ("last_group", "launch"):
            cases.append(_merge_case(lens, heads, d, combine))
    # more partitions than two a lane of the merge: 65 (3 a lane) and 126 (4), merged in the launch
    if not small:
        cases.append(_merge_case([8300, 5000], (32, 8), 128, "last_group", {"attn_partition": 128}))
        cases.append(_merge_case([16100], (16, 8), 64, "last_group", {"attn_partition": 128}))
    # fewer V vectors in flight (the attn_v_prefetch option) at Llama-3's heads, a mixed batch; and
    # the combine launch over more than its 64 partitions a block (sequences of 71 and 32 partitions)
    for vpf in (1, 2):
        if not small:
            cases.append(_paged_case("v2", [4100, 2049, 600], (32, 8), 128, 16, {"attn_v_prefetch": vpf}))
            cases.append(_contiguous_case(True, [4100, 2049, 600], (32, 8), 128, 4100, opts={"attn_v_prefetch": vpf}))
    cases.append(_contiguous_case(True, [1, 17], (16, 8), 64, 17, opts={"attn_v_prefetch": 1}))
    if not small:
        cases.append(_contiguous_case(True, [9000, 4000], (32, 8), 128, 9000,
                                      opts={"attn_partition": 128, "attn_combine": "launch"}))
        cases.append(_paged_case("v2", [9000, 4000], (16, 8), 256, 32,
                                 {"attn_partition": 128, "attn_combine": "launch"}))
    # K in registers and in one slot of threadgroup memory (attn_k_slots; the default takes two):
    # partitions of three chunks (the last one short) over a mixed batch, the unsplit body, the
    # RoPE launch whose new row lies in one partition (that threadgroup copies K after its
    # write), the head norms, the merge
    for slots in (0, 1):
        o = {"attn_k_slots": slots}
        if not small:
            cases.append(_contiguous_case(True, [4100, 2049, 600], (32, 8), 128, 4100, opts={**o, "attn_partition": 384}))
            cases.append(_paged_case("v2", [4100, 2049, 600], (16, 8), 64, 16, {**o, "attn_partition": 384}))
            cases.append(_rope_decode_case(1500, (32, 8), 128, False, True, True, opts=o))
            cases.append(_rope_decode_case(900, (16, 8), 128, True, True, False, head_norm=True, opts=o))
            cases.append(_merge_case([4097], (32, 8), 128, "last_group", opts=o))
        cases.append(_contiguous_case(False, [1, 17, 513], (16, 8), 256, 513, opts=o))
        cases.append(_rope_decode_case(70, (16, 16), 64, True, False, True, opts=o))
    # scores and P.V on SIMD-group matrices (attn_mma; auto takes them from 4 heads a threadgroup):
    # off at Llama-3's heads, on at two and at seven heads (a fragment's rows past G), auto at
    # Llama-3.2-1B's (D = 64: two SIMD groups across D, two across a chunk's tokens); paged (a V
    # word of 8 tokens masked at a sequence's end) and contiguous, split, unsplit, merged, RoPE
    for mma, heads, d in (("off", (32, 8), 128), ("on", (16, 8), 128), ("on", (28, 4), 128),
                          ("auto", (32, 8), 64)):
        o = {"attn_mma": mma}
        cases.append(_paged_case("v2", [1, 37, 259], heads, d, 16, o))
        cases.append(_contiguous_case(False, [5, 131], heads, d, 131, opts=o))
        if not small:
            cases.append(_paged_case("v2", [4100, 2049, 603], heads, d, 32, {**o, "attn_partition": 384}))
            cases.append(_contiguous_case(True, [4101, 1000], heads, d, 4101, opts=o))
            cases.append(_merge_case([4097], heads, d, "last_group", opts=o))
            cases.append(_rope_decode_case(1500, heads, d, False, True, True, opts=o))
    # K copied by whole rows into a swizzled slot (attn_k_copy=row; the MMA form, contiguous):
    # chunks ending inside a SIMD group's tokens, several chunks a partition, the RoPE launch
    o = {"attn_k_copy": "row"}
    cases.append(_contiguous_case(False, [5, 131], (32, 8), 128, 131, opts=o))
    if not small:
        cases.append(_contiguous_case(True, [4101, 1000], (32, 8), 64, 4101, opts={**o, "attn_partition": 384}))
        cases.append(_rope_decode_case(1500, (32, 8), 128, False, True, True, opts=o))
    # the default's two slots over partitions of several chunks (the next chunk's first round
    # copied during a chunk's softmax and P.V), paged and contiguous, every head dim
    if not small:
        for heads, d, bs in (((32, 8), 128, 16), ((16, 8), 64, 32), ((8, 4), 256, 16)):
            cases.append(_paged_case("v2", [5000, 1100, 129], heads, d, bs, {"attn_partition": 512}))
            cases.append(_contiguous_case(True, [5000, 1100, 129], heads, d, 5000, opts={"attn_partition": 512}))
    # the paged kernel's partitions merged in its launch
    if not small:
        cases.append(_paged_case("v2", [4100, 2049, 600], (32, 8), 128, 16, {"attn_combine": "last_group"}))
    # a batch's decode tokens over the pool with their RoPE and K/V writes (serve's steps):
    # Qwen3's heads and norms, first tokens and block edges; Llama's pairs from host ids; D 64
    # and 256; split contexts merged by a launch or by the last threadgroup; the MMA form
    cases.append(_paged_rope_case([1, 17, 130, 16], (16, 8), 128, 16, True, True, head_norm=True))
    cases.append(_paged_rope_case([5, 129, 600], (32, 8), 128, 16, False, False))
    cases.append(_paged_rope_case([3, 64, 65], (32, 8), 64, 32, True, True))
    if not small:
        cases.append(_paged_rope_case([40, 300], (8, 4), 256, 16, True, True, head_norm=True))
        cases.append(_paged_rope_case([4100, 1000, 33], (32, 8), 128, 16, False, True))
        cases.append(_paged_rope_case([4100, 1000, 33], (16, 8), 128, 16, True, True, head_norm=True,
                                      opts={"attn_combine": "last_group"}))
        cases.append(_paged_rope_case([1, 37, 259], (16, 8), 128, 16, True, True, head_norm=True,
                                      opts={"attn_mma": "on"}))
    cases.append(_reshape_case(37, 8, 128, 16))
    cases.append(_reshape_case(64, 4, 64, 32))
    return cases


def _vs_mlx_sdpa(head_dim: int) -> CheckCase:
    def run(rng: np.random.Generator) -> list[Comparison]:
        q = rng.standard_normal((32, head_dim)).astype(np.float32)
        k = rng.standard_normal((100, 8, head_dim)).astype(np.float32)
        v = rng.standard_normal((100, 8, head_dim)).astype(np.float32)
        scale = head_dim ** -0.5
        ours = ref.attend(q, k, v, scale)
        theirs = mx.fast.scaled_dot_product_attention(
            mx.array(q)[None, :, None, :], mx.array(k.transpose(1, 0, 2))[None],
            mx.array(v.transpose(1, 0, 2))[None], scale=scale, stream=mx.cpu)
        return [compare("vs mx.fast.scaled_dot_product_attention", np.array(theirs)[0, :, 0, :], ours, 1e-5)]

    return CheckCase("attention", "reference.attend", "vs mlx sdpa (cpu, fp32)", dict(D=head_dim),
                     run, needs_gpu=False)


def reference_cases() -> list[CheckCase]:
    return [_vs_mlx_sdpa(d) for d in (64, 128)]


# ---- benchmarks --------------------------------------------------------------------------------------
BENCH_CONTEXTS = (512, 2048, 8192, 32768)
# (query heads, kv heads, head_dim): the two decode presets' heads, and the other head dims of real models
# (Llama-3.2-1B's 64, Gemma-2's 256)
BENCH_MODELS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}
HEAD_DIM_MODELS = {"llama3.2-1b": (32, 8, 64), "gemma2-2b": (8, 4, 256)}


def mixed_lengths(batch: int, ctx: int) -> list[int]:
    """A batch's context lengths spread evenly from ctx down to about ctx/2 (most of them not a
    multiple of the block size): the mixed batch a server decodes, as vLLM's kernel benchmark
    draws it, but fixed so that runs compare."""
    return [ctx - (ctx // 2) * i // max(batch - 1, 1) for i in range(batch)]


def _bench(kernel: str, model: str, batch: int, ctx: int, chained: bool = False, mixed: bool = False):
    """One decode step's attention at context ctx for every sequence of the batch (`mixed`: the
    lengths of mixed_lengths, ctx the longest). Bytes: the K and V rows each sequence holds, read
    once, q read, out written (fp16). MLX's sdpa takes a mixed batch as one [B, Hkv, ctx, D]
    cache and a boolean mask, as a user of it would. `chained`: each call's q waits for the call
    before (mx.depends), as a decode layer waits for the one before it, so that GPU time a call
    is one call's latency; unchained, a round's calls overlap on the GPU and its busy time a call
    measures throughput, which hides a launch's tail (kernels/attention/NOTES.md)."""
    from harness.bench import BenchCase
    from kernels.attention import flash_decode, merge_counters, paged_attention

    n_heads, n_kv, head_dim = (BENCH_MODELS | HEAD_DIM_MODELS)[model]
    bs = 16
    lens = mixed_lengths(batch, ctx) if mixed else [ctx] * batch
    kv_bytes = 2 * n_kv * sum(lens) * head_dim * 2
    nbytes = kv_bytes + 2 * 2 * batch * n_heads * head_dim
    scale = head_dim ** -0.5
    blocks_of = [-(-n // bs) for n in lens]  # a paged sequence's blocks

    # A set's calls share its merge counters (a split launch merges its partitions in itself), so
    # each call is ordered after the one before on the same set (mx.depends); calls on different
    # sets stay free to overlap, as MLX's sdpa calls are.
    def make():
        q = mx.random.normal((batch, n_heads, head_dim)).astype(mx.float16)
        counters = merge_counters(batch * n_heads)
        if kernel.startswith("paged"):
            # every sequence's blocks scattered over the pool; rows padded with block 0 past their length
            blocks, order = sum(blocks_of), np.random.default_rng(ctx).permutation(sum(blocks_of))
            table = np.zeros((batch, max(blocks_of)), np.int32)
            for b, start in enumerate(np.cumsum([0] + blocks_of[:-1])):
                table[b, : blocks_of[b]] = order[start: start + blocks_of[b]]
            table = mx.array(table)
            return {"q": q, "k": mx.random.normal((blocks, n_kv, head_dim // 8, bs, 8)).astype(mx.float16),
                    "v": mx.random.normal((blocks, n_kv, head_dim, bs)).astype(mx.float16), "table": table,
                    "counters": counters}
        k = mx.random.normal((batch, n_kv, ctx, head_dim)).astype(mx.float16)
        return {"q": q, "k": k, "v": mx.random.normal(k.shape).astype(mx.float16), "counters": counters}

    def ordered(s, out):
        s["counters"] = mx.depends([s["counters"]], [out])[0]
        return [out]

    def held(rows: int) -> mx.array:  # sdpa's boolean mask [B, 1, 1, rows]: True where a sequence has a row
        return mx.array(lens)[:, None, None, None] > mx.arange(rows)

    if kernel == "mlx.sdpa":
        mask = held(ctx) if mixed else None
        step = lambda s: [mx.fast.scaled_dot_product_attention(  # noqa: E731
            s["q"][:, :, None, :], s["k"], s["v"], scale=scale, mask=mask)]
    elif kernel == "flash_decode":
        step = lambda s: ordered(s, flash_decode(s["q"], s["k"], s["v"], lens, scale,  # noqa: E731
                                                 counters=s["counters"]))
    else:
        version = kernel.split("_")[-1]
        table_host = []

        def step(s):
            if not table_host:  # the host copy the argument checks read, made once
                table_host.append(np.array(s["table"]))
            return ordered(s, paged_attention(s["q"], s["k"], s["v"], table_host[0], lens, scale,
                                              version=version, counters=s["counters"]))
    def verify() -> float:
        """rel_err of the kernel's output against MLX's sdpa (masked to each sequence's rows) on
        one fresh set: a row's bandwidth only counts if the kernel read what it was given."""
        s = make()
        (got,) = step(s)
        k, v = (s["k"], s["v"]) if "table" not in s else contiguous_cache(s["k"], s["v"], s["table"])
        want = mx.fast.scaled_dot_product_attention(s["q"][:, :, None, :], k, v, scale=scale, mask=held(k.shape[2]))
        return rel_err(np.array(got, dtype=np.float64), np.array(want[:, :, 0, :], dtype=np.float64))

    if chained:
        each, last = step, []

        def step(s):
            if last:
                s["q"] = mx.depends([s["q"]], [last[0]])[0]
            outs = each(s)
            last[:] = outs[:1]
            return outs
    shape = dict(batch=batch, ctx=ctx, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                 block_size=bs if kernel.startswith("paged") else 0)
    name = f"attention-decode-{'chain-' if chained else ''}b{batch}{'-mixed' if mixed else ''}"
    return BenchCase("attention", name, kernel, model, shape, make, step,
                     nbytes, 4 * n_heads * sum(lens) * head_dim, nbytes,
                     None if kernel == "mlx.sdpa" or chained else verify)


def contiguous_cache(k_pool: mx.array, v_pool: mx.array, table: mx.array) -> tuple[mx.array, mx.array]:
    """vLLM's paged pools (K [blocks, Hkv, D/8, BS, 8], V [blocks, Hkv, D, BS]) read through a
    block table [B, max_blocks] as contiguous caches [B, Hkv, max_blocks * BS, D]."""
    batch, rows = table.shape
    _, n_kv, d8, bs, _ = k_pool.shape
    k = k_pool[table].transpose(0, 2, 1, 4, 3, 5).reshape(batch, n_kv, rows * bs, d8 * 8)
    v = v_pool[table].transpose(0, 2, 1, 4, 3).reshape(batch, n_kv, rows * bs, d8 * 8)
    return k, v


def _bench_prefill(kernel: str, tokens: int, pos: int = 0, model: str = "llama3-8b", block_size: int = 0):
    """A prompt of `tokens` at positions pos .. pos+tokens-1 attending causally over the cache
    (its own K and V after pos earlier tokens'). kernel: "wgmma", "tiled" or "decode"
    (prefill_attention's kernels), or "mlx.sdpa" (causal, its mask aligned to the end of the keys). Bytes: K and V
    read once, q read, out written (the floor; a kernel re-reads K and V from L2 for each query
    tile); flops: the two products over the causal half. With a block size, the same cache as
    vLLM's paged pool, its blocks in a shuffled order (the row's kernel is named `<kernel> paged`)."""
    from harness.bench import BenchCase
    from kernels.attention import prefill_attention

    n_heads, n_kv, head_dim = BENCH_MODELS[model]
    scale = head_dim ** -0.5
    keys = pos + tokens
    nbytes = 2 * n_kv * keys * head_dim * 2 + 2 * 2 * tokens * n_heads * head_dim
    flops = 4 * tokens * (pos + (tokens + 1) // 2) * n_heads * head_dim

    blocks = -(-keys // block_size) if block_size else 0
    table = np.random.default_rng(0).permutation(blocks).astype(np.int32) if block_size else None

    # the pool's layout where paged (random values: only the bytes' places matter here)
    k_shape = (blocks, n_kv, head_dim // 8, block_size, 8) if block_size else (n_kv, keys, head_dim)
    v_shape = (blocks, n_kv, head_dim, block_size) if block_size else (n_kv, keys, head_dim)

    def make():
        return {"q": mx.random.normal((tokens, n_heads, head_dim)).astype(mx.float16),
                "k": mx.random.normal(k_shape).astype(mx.float16),
                "v": mx.random.normal(v_shape).astype(mx.float16)}

    if block_size:
        step = lambda s, k=kernel: [prefill_attention(s["q"], s["k"], s["v"], pos, scale,  # noqa: E731
                                                      block_table=table, kernel=k)]
        kernel = f"{kernel} paged"
    elif kernel == "mlx.sdpa":
        step = lambda s: [mx.fast.scaled_dot_product_attention(  # noqa: E731
            s["q"].transpose(1, 0, 2)[None], s["k"][None], s["v"][None], scale=scale, mask="causal")]
    else:
        step = lambda s: [prefill_attention(s["q"], s["k"], s["v"], pos, scale, kernel=kernel)]  # noqa: E731
    shape = dict(batch=1, ctx=keys, tokens=tokens, pos=pos, n_heads=n_heads, n_kv_heads=n_kv,
                 head_dim=head_dim, block_size=block_size)
    return BenchCase("attention", "attention-prefill", kernel, model, shape, make, step, nbytes, flops, nbytes)


PREFILL_PROMPTS = ((512, 0), (2048, 0), (8192, 0), (512, 4096), (16, 4096))  # (tokens, pos)


def bench_cases(quick: bool = False) -> list:
    cases = []
    for model in ("llama3-8b",) if quick else BENCH_MODELS:
        for batch in (1,) if quick else (1, 8):
            for ctx in (512, 8192) if quick else BENCH_CONTEXTS:
                for kernel in ("flash_decode", "paged_v1", "paged_v2", "mlx.sdpa"):
                    cases.append(_bench(kernel, model, batch, ctx))
    if not quick:
        # the other head dims at batch 1, and mixed batches of 8 and 32 at long contexts
        for model in HEAD_DIM_MODELS:
            for ctx in BENCH_CONTEXTS:
                cases += [_bench(kernel, model, 1, ctx) for kernel in ("flash_decode", "paged_v1", "paged_v2", "mlx.sdpa")]
        for model in BENCH_MODELS:
            for batch in (8, 32):
                for ctx in (8192, 32768):
                    cases += [_bench(kernel, model, batch, ctx, mixed=True)
                              for kernel in ("flash_decode", "paged_v1", "paged_v2", "mlx.sdpa")]
    # one sequence, each call waiting for the one before: the latency a decode layer pays
    for model in ("llama3-8b",) if quick else BENCH_MODELS:
        for ctx in (8192,) if quick else BENCH_CONTEXTS:
            cases += [_bench(kernel, model, 1, ctx, chained=True) for kernel in ("flash_decode", "paged_v2", "mlx.sdpa")]
    if not quick:
        # a serve step's short contexts (lathe serve's 128 + 128 tokens: 129..256 a sequence), each call
        # waiting for the one before: the paged walk against the contiguous cache at the same lengths
        for model in BENCH_MODELS:
            for batch in (8, 32):
                cases += [_bench(kernel, model, batch, 256, chained=True, mixed=True)
                          for kernel in ("flash_decode", "paged_v1", "mlx.sdpa")]
    from kernels import native

    # the wgmma kernel where it runs (Hopper), beside the portable one
    prefill_kernels = ("wgmma",) * native.available() + ("tiled", "decode", "mlx.sdpa")
    for tokens, pos in ((512, 0),) if quick else PREFILL_PROMPTS:
        for model in ("llama3-8b",) if quick else BENCH_MODELS:
            # the decode kernel only where a call takes well under a few seconds
            cases += [_bench_prefill(k, tokens, pos, model) for k in prefill_kernels
                      if not (k == "decode" and tokens * (pos + tokens) > 2048 * 4096)]
            # over the paged pool (the decode loop's paged option), blocks of 16
            cases += [_bench_prefill(k, tokens, pos, model, 16) for k in prefill_kernels
                      if k in ("wgmma", "tiled")]
    return cases


def plots(df, out_dir, peak_gbs):
    """One PNG a benchmark and model: GB/s by wall time beside GB/s by GPU time, a line a kernel,
    from the rows run with the default options (an A/B run's rows, `--set ...`, are newer and
    would otherwise take a line's place)."""
    from harness.plots import bandwidth_plot

    if "options" in df.columns:
        df = df[df["options"].fillna("") == ""]
    paths = []
    for bench in sorted(df.benchmark.unique()):
        for model in sorted(df[df.benchmark == bench].variant.unique()):
            sub = df[(df.benchmark == bench) & (df.variant == model)]
            paths.append(bandwidth_plot(sub, "ctx", out_dir / f"{bench}-{model}.png",
                                        f"{bench} {model}: GB/s against context", peak_gbs=peak_gbs,
                                        line_by="kernel", gpu_time=True))
    return paths
