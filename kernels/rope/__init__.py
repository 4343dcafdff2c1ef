"""The RoPE family: seven kernels over four MSL bodies (pairing and forms are compile-time switches).

| kernel                         | body                          | switches                  |
| ------------------------------ | ----------------------------- | ------------------------- |
| rope, rope_neox                | rope.metal                    | NEOX, FREQ_TABLE, POSITION_IDS |
| rope_qkv_write, rope_neox_...  | rope_kv_write.metal           | NEOX, FREQ_TABLE, form    |
| rope_batch_kv_write, ..._neox_ | rope_kv_write.metal           | NEOX, FREQ_TABLE, form    |
| head_norm_rope_neox_kv_write   | head_norm_rope_kv_write.metal | NEOX, FREQ_TABLE, form    |
| cache_write, head_rmsnorm      | the unfused path's pieces     |                           |
| cache_read                     | a GPU reader ordered by token |                           |

fp16 in and out, fp32 math. Heads are laid out [seq, n_heads, head_dim]; KV caches are head-major
[n_kv_heads, max_seq, head_dim]. Cache writers come in two forms (DESIGN.md): ``functional``
returns caches updated by MLX slice updates; ``in_place`` writes through the cache buffers and
returns an ordering token that GPU readers take as an input (see `Rotated`). Either way:
``q, k_cache, v_cache, written = f(...)``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from kernels.paged import pool_shape
from kernels.runtime import (FORMS, KernelSpec, Launch, cache_io, cache_prelude, constant, depends, index, launch,
                             resident)

FREQS = ("table", "inline")
# Launch tuning: threads per threadgroup, and heads per thread (HPT, a compile-time constant) for
# short and long inputs. Chosen from `lathe bench rope --sweep` on the device (results/<device>/
# rope.csv, benchmarks rope-sweep-*); see kernels/rope/NOTES.md.
TUNING = {"threads": 256, "hpt_decode": 1, "hpt_short": 4, "hpt_long": 8, "long_from": 1024}
_INT32_LIMIT = 2**31 - 1
_GRID_YZ_LIMIT = 65535  # CUDA's limit on grid y and z (in threadgroups); seq runs along z


class Rotated(NamedTuple):
    """Result of a RoPE + KV write: rotated q[seq, n_heads, D] and the updated caches.

    In the in-place form, `written` is the write's ordering token: a GPU reader of the cache in
    the same graph must take it as an input (see `cache_read`). A reader is then ordered after
    this write, and after earlier writes too when each write is ordered after the previous
    reader (a decode loop: the next token's QKV comes out of the last attention). MLX orders
    work on CUDA by the buffers each op declares as outputs, and the cache is not one, so an MLX
    built-in op reading the cache in the same graph is NOT ordered after the write. The returned
    caches are wrapped by ``mx.depends`` on the token, which orders evaluation, e.g. host reads
    after ``mx.eval``.
    In the functional form `written` is None and every reader is ordered by MLX as usual.
    """

    q: mx.array
    k_cache: mx.array
    v_cache: mx.array
    written: mx.array | None = None


# ---- argument checks (all before any launch) -----------------------------------------------------
def _check_fp16(name: str, a: mx.array) -> None:
    if not isinstance(a, mx.array):
        raise ValueError(f"{name} must be an mx.array, got {type(a).__name__}")
    if a.dtype != mx.float16:
        raise ValueError(f"{name} must be float16, got {a.dtype}")


def _check_head_dim(head_dim: int, multiple: int = 2) -> None:
    if head_dim <= 0 or head_dim % multiple or head_dim > 1024:
        raise ValueError(
            f"head_dim must be a positive multiple of {multiple} up to 1024, got {head_dim}"
        )


def _check_heads(n_heads: int, n_kv_heads: int) -> None:
    if n_heads <= 0 or n_kv_heads <= 0:
        raise ValueError(f"head counts must be positive, got {n_heads} and {n_kv_heads}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")


def _check_size(name: str, n: int) -> None:
    if n > _INT32_LIMIT:
        raise ValueError(f"{name} has {n} elements; the kernels index with 32-bit integers")


def _check_seq(seq: int) -> None:
    if not 1 <= seq <= _GRID_YZ_LIMIT:
        raise ValueError(f"seq must be in 1..{_GRID_YZ_LIMIT}, got {seq}")


def _check_freqs(freqs: str) -> None:
    if freqs not in FREQS:
        raise ValueError(f"freqs must be one of {FREQS}, got {freqs!r}")


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def _pos_array(pos: int | mx.array, seq: int, max_seq: int | None) -> mx.array:
    """pos as int32[1]. A Python int is range-checked; a device array (chained decode) is
    checked in the kernel, which drops rows past the cache instead of writing out of bounds."""
    if isinstance(pos, mx.array):
        if pos.size != 1 or pos.dtype != mx.int32:
            raise ValueError(f"pos array must be int32 with one element, got {pos.dtype}{pos.shape}")
        return pos.reshape(1)
    pos = int(pos)
    if pos < 0:
        raise ValueError(f"pos must be >= 0, got {pos}")
    if max_seq is not None and pos + seq > max_seq:
        raise ValueError(f"pos + seq = {pos + seq} is beyond the cache ({max_seq} rows)")
    return index(pos)


def position(pos: int | mx.array) -> mx.array:
    """pos as the int32[1] array the kernels and slice updates take (cached per value)."""
    return _pos_array(pos, 1, None)


def _check_cache(name: str, cache: mx.array, n_kv_heads: int, head_dim: int) -> int:
    _check_fp16(name, cache)
    if cache.ndim != 3 or cache.shape[0] != n_kv_heads or cache.shape[2] != head_dim:
        raise ValueError(
            f"{name} must be [n_kv_heads={n_kv_heads}, max_seq, head_dim={head_dim}], "
            f"got {tuple(cache.shape)}"
        )
    _check_size(name, cache.size)
    return cache.shape[1]


# ---- small constant inputs, built once per value ------------------------------------------------
@functools.lru_cache(maxsize=64)
def inv_freq_table(head_dim: int, theta: float) -> mx.array:
    """theta^(-2i/D) as float32[D/2], computed in float64 on the host."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return resident(mx.array((np.float64(theta) ** -exponents).astype(np.float32)))


def _int32(values: tuple[int, ...]) -> mx.array:
    return constant(values)


def _float32(values: tuple[float, ...]) -> mx.array:
    return constant(values, mx.float32)


def _table(head_dim: int, theta: float, inv_freq: mx.array | None) -> mx.array:
    if inv_freq is None:
        return inv_freq_table(head_dim, float(theta))
    if inv_freq.dtype != mx.float32 or inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must be float32[{head_dim // 2}], got {inv_freq.dtype}{inv_freq.shape}")
    return inv_freq


def _heads_per_thread(seq: int) -> int:
    # Decode: few heads per thread for parallelism; prefill: several heads per thread share the
    # angles and keep as many loads in flight.
    if seq < 16:
        return TUNING["hpt_decode"]
    return TUNING["hpt_short"] if seq < TUNING["long_from"] else TUNING["hpt_long"]


def _geometry(threads_x: int, groups: int, seq: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    ty = max(1, min(groups, TUNING["threads"] // threads_x))
    return (threads_x, groups, seq), (threads_x, ty, 1)


# ---- rope / rope_neox ----------------------------------------------------------------------------
_ROPE = KernelSpec(
    name="lathe_rope",
    body="rope/rope.metal",
    inputs=("x", "positions", "inv_freq", "scalars", "dims"),
    outputs=("out",),
)


def _rope(
    x: mx.array,
    pos: int | mx.array,
    *,
    neox: bool,
    theta: float,
    freq_scale: float,
    freqs: str,
    inv_freq: mx.array | None,
    position_ids: mx.array | None,
) -> mx.array:
    _check_fp16("x", x)
    if x.ndim != 3:
        raise ValueError(f"x must be [seq, n_heads, head_dim], got {tuple(x.shape)}")
    seq, n_heads, head_dim = x.shape
    _check_head_dim(head_dim, multiple=4)
    _check_seq(seq)
    _check_size("x", x.size)
    _check_freqs(freqs)
    if position_ids is not None:
        if position_ids.dtype != mx.int32 or position_ids.shape != (seq,):
            raise ValueError(f"position_ids must be int32[{seq}], got {position_ids.dtype}{position_ids.shape}")
        positions = position_ids
    else:
        positions = _pos_array(pos, seq, None)
    hpt = _heads_per_thread(seq)
    grid, tg = _geometry(head_dim // 4, -(-n_heads // hpt), seq)
    (out,) = launch(
        Launch(
            _ROPE,
            [x, positions, _table(head_dim, theta, inv_freq), _float32((theta, freq_scale)),
             _int32((seq, n_heads))],
            [(x.shape, mx.float16)],
            grid,
            tg,
            dict(D=head_dim, NEOX=neox, FREQ_TABLE=freqs == "table" or inv_freq is not None,
                 POSITION_IDS=position_ids is not None, HPT=hpt),
        )
    )
    return out


def rope(x, pos=0, *, theta=10000.0, freq_scale=1.0, freqs="table", inv_freq=None, position_ids=None):
    """Standard (interleaved pairs) RoPE of x[seq, n_heads, D]; token t at pos + t (or position_ids[t])."""
    return _rope(x, pos, neox=False, theta=theta, freq_scale=freq_scale, freqs=freqs,
                 inv_freq=inv_freq, position_ids=position_ids)


def rope_neox(x, pos=0, *, theta=10000.0, freq_scale=1.0, freqs="table", inv_freq=None, position_ids=None):
    """NeoX (split-half pairs) RoPE of x[seq, n_heads, D]; optional per-token position_ids."""
    return _rope(x, pos, neox=True, theta=theta, freq_scale=freq_scale, freqs=freqs,
                 inv_freq=inv_freq, position_ids=position_ids)


# ---- fused RoPE + KV write ----------------------------------------------------------------------
class _Rows(NamedTuple):
    """Where a token's heads live: token t at array[t * stride + offset], heads contiguous."""

    array: mx.array
    stride: int
    offset: int


def _separate(name: str, a: mx.array, heads: int, head_dim: int, seq: int | None) -> _Rows:
    _check_fp16(name, a)
    width = heads * head_dim
    if a.ndim == 3 and a.shape[1:] == (heads, head_dim):
        a = a.reshape(a.shape[0], width)
    if a.ndim != 2 or a.shape[1] != width or (seq is not None and a.shape[0] != seq):
        want = f"[{seq if seq is not None else 'seq'}, {heads} * {head_dim}]"
        raise ValueError(f"{name} must be {want}, got {tuple(a.shape)}")
    _check_size(name, a.size)
    return _Rows(a, width, 0)


def _fused_qkv(qkv: mx.array, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[_Rows, _Rows, _Rows]:
    _check_fp16("qkv", qkv)
    width = (n_heads + 2 * n_kv_heads) * head_dim
    if qkv.ndim == 1:
        qkv = qkv.reshape(1, -1)
    if qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"qkv must be [seq, (n_heads + 2 * n_kv_heads) * head_dim = {width}], got {tuple(qkv.shape)}"
        )
    _check_size("qkv", qkv.size)
    q_off, v_off = n_heads * head_dim, (n_heads + n_kv_heads) * head_dim
    return _Rows(qkv, width, 0), _Rows(qkv, width, q_off), _Rows(qkv, width, v_off)


@functools.cache
def _paged_kv_spec(norm: bool) -> KernelSpec:
    """rope_kv_write.metal (head_norm_rope_kv_write.metal with `norm`) over vLLM's block pool:
    position ids and a slot a token."""
    return KernelSpec(
        name="lathe_head_norm_rope_kv_write_paged" if norm else "lathe_rope_kv_write_paged",
        body="rope/head_norm_rope_kv_write.metal" if norm else "rope/rope_kv_write.metal",
        inputs=("q", "k", "v", *(("q_weight", "k_weight") if norm else ()), "pos", "inv_freq", "scalars", "dims",
                "slots", "k_cache", "v_cache"),
        outputs=("q_out", "written"),
        prelude="#define LATHE_PAGED 1\nauto k_dst = writable(k_cache);\nauto v_dst = writable(v_cache);\n"
                "if (thread_position_in_grid.x == 0 && thread_position_in_grid.y == 0 && "
                "thread_position_in_grid.z == 0) { written[0] = 1u; }",
        in_place=("k_cache", "v_cache"),
        threadgroup_bytes=(lambda c: 4 * (c["D"] // 64)) if norm else None,
    )


_PAGED_KV = {norm: _paged_kv_spec(norm) for norm in (False, True)}


def rope_paged_kv_write(q, k, v, k_cache, v_cache, positions, slots, *, theta=10000.0, freq_scale=1.0,
                        freqs="table", inv_freq=None, neox=False, q_norm=None, k_norm=None, eps=1e-6) -> Rotated:
    """A batch's tokens over vLLM's block pool (k_cache [blocks, Hkv, D/8, BS, 8], v_cache
    [blocks, Hkv, D, BS]): q[T, n_heads * D] rotated, K rotated and V copied into the caches at
    `slots` (block * BS + row; host ints checked here, or int32[T] on the device, where a slot
    outside the pool is dropped), token t at position positions[t] (int32[T], host or device).
    One launch for what RoPE of q, RoPE of k and reshape_and_cache do in three. With q_norm and
    k_norm (float32 [D]; NeoX, D a multiple of 64): Qwen3's per-head RMSNorm of Q and K first, in
    the same launch (head_norm_rope_kv_write.metal)."""
    _, n_kv, head_dim, _ = pool_shape(k_cache, v_cache)
    seq, n_heads = q.shape[0], _head_count("q", q, head_dim)
    rows = [_separate(name, a, heads, head_dim, seq) for name, a, heads in
            (("q", q, n_heads), ("k", k, n_kv), ("v", v, n_kv))]
    return _paged_write(rows, n_heads, k_cache, v_cache, positions, slots, theta=theta, freq_scale=freq_scale,
                        freqs=freqs, inv_freq=inv_freq, neox=neox, q_norm=q_norm, k_norm=k_norm, eps=eps)


def rope_paged_qkv_write(qkv, k_cache, v_cache, positions, slots, *, n_heads, **kw) -> Rotated:
    """rope_paged_kv_write reading Q, K and V where a fused QKV projection left them:
    qkv[T, (n_heads + 2 n_kv) * D], Q then K then V heads a row. No slices of it, so no copies: MLX
    copies a column slice of more than one row (not row-contiguous) before a launch that takes it,
    three launches a layer in a batched step (kernels/loop/NOTES.md)."""
    _, n_kv, head_dim, _ = pool_shape(k_cache, v_cache)
    return _paged_write(_fused_qkv(qkv, n_heads, n_kv, head_dim), n_heads, k_cache, v_cache, positions, slots, **kw)


def _paged_write(rows, n_heads, k_cache, v_cache, positions, slots, *, theta=10000.0, freq_scale=1.0,
                 freqs="table", inv_freq=None, neox=False, q_norm=None, k_norm=None, eps=1e-6) -> Rotated:
    """The paged RoPE + K/V write's launch, Q, K and V given as rows (array, stride, offset)."""
    blocks, n_kv, head_dim, block_size = pool_shape(k_cache, v_cache)
    norm = q_norm is not None or k_norm is not None
    _check_head_dim(head_dim, multiple=64 if norm else 4)
    _check_heads(n_heads, n_kv)
    if norm:
        if q_norm is None or k_norm is None or not neox:
            raise ValueError("the head norms take both q_norm and k_norm, with NeoX RoPE (Qwen3's)")
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if not isinstance(w, mx.array) or w.dtype != mx.float32 or w.shape != (head_dim,):
                raise ValueError(f"{name} must be float32[{head_dim}], got {getattr(w, 'dtype', type(w))}"
                                 f"{getattr(w, 'shape', '')}")
    _check_freqs(freqs)
    seq = rows[0].array.shape[0]
    _check_seq(seq)
    ids = []
    for name, a in (("positions", positions), ("slots", slots)):
        if isinstance(a, mx.array):
            if a.dtype != mx.int32 or tuple(a.shape) != (seq,):
                raise ValueError(f"{name} must be int32[{seq}], got {a.dtype}{tuple(a.shape)}")
            ids.append(a)
            continue
        host = np.asarray(a, dtype=np.int64).reshape(-1)
        if host.shape != (seq,):
            raise ValueError(f"{seq} tokens but {host.size} {name}")
        top = 2**24 if name == "positions" else blocks * block_size  # positions: exact in float32
        if host.min() < 0 or host.max() >= top:
            raise ValueError(f"{name} must be in 0..{top - 1}, got {host.min()}..{host.max()}")
        ids.append(mx.array(host.astype(np.int32)))
    dims = _int32((seq, n_heads, n_kv, blocks * block_size, rows[0].stride, rows[0].offset, rows[1].stride,
                   rows[1].offset, rows[2].stride, rows[2].offset))
    constants = dict(D=head_dim, NEOX=neox, FREQ_TABLE=freqs == "table" or inv_freq is not None, BS=block_size)
    if norm:  # a threadgroup of D/2 threads a (Q head, token), K and V with the first n_kv heads
        grid, tg = (head_dim // 2, n_heads, seq), (head_dim // 2, 1, 1)
        weights, scalars = [q_norm, k_norm], (theta, freq_scale, float(eps))
    else:
        hpt = constants["HPT"] = _heads_per_thread(seq)
        grid, tg = _geometry(head_dim // 4, -(-(n_heads + 2 * n_kv) // hpt), seq)
        weights, scalars = [], (theta, freq_scale)
    inputs = [r.array for r in rows] + weights + [ids[0], _table(head_dim, theta, inv_freq), _float32(scalars),
                                                  dims, ids[1], k_cache, v_cache]
    q_out, written = launch(Launch(_PAGED_KV[norm], inputs,
                                   [((seq, n_heads, head_dim), mx.float16), ((1,), mx.uint32)], grid, tg, constants))
    k_cache, v_cache = depends([k_cache, v_cache], [written])
    return Rotated(q_out, k_cache, v_cache, written)


def _kv_spec(body: str, form: str, norm: bool) -> KernelSpec:
    extra_in, extra_out = cache_io(form, ("k", "v"))
    weights = ("q_weight", "k_weight") if norm else ()
    stem = body.split("/")[-1].removesuffix(".metal")
    return KernelSpec(
        name=f"lathe_{stem}_{form}",
        body=body,
        inputs=("q", "k", "v", *weights, "pos", "inv_freq", "scalars", "dims", *extra_in),
        outputs=("q_out", *extra_out),
        prelude="#define LATHE_PAGED 0\n" + cache_prelude(form, ("k", "v")),
        in_place=extra_in,  # the caches, in the in_place form
        # head_norm_rope_kv_write.metal: a threadgroup of D/2 threads reduces over NSIMD = D/64
        threadgroup_bytes=(lambda c: 4 * (c["D"] // 64)) if norm else None,
    )


def _kv_write(
    q: _Rows,
    k: _Rows,
    v: _Rows,
    k_cache: mx.array,
    v_cache: mx.array,
    pos: int | mx.array,
    *,
    n_heads: int,
    head_dim: int,
    neox: bool,
    theta: float,
    freq_scale: float,
    freqs: str,
    inv_freq: mx.array | None,
    form: str,
    norm: tuple[mx.array, mx.array, float] | None = None,
) -> Rotated:
    """Shared launch of rope_kv_write.metal (norm=None) and head_norm_rope_kv_write.metal."""
    _check_form(form)
    _check_freqs(freqs)
    n_kv_heads = k_cache.shape[0] if k_cache.ndim == 3 else -1
    _check_heads(n_heads, n_kv_heads)
    max_seq = _check_cache("k_cache", k_cache, n_kv_heads, head_dim)
    if _check_cache("v_cache", v_cache, n_kv_heads, head_dim) != max_seq:
        raise ValueError(f"k_cache and v_cache differ in shape: {k_cache.shape} vs {v_cache.shape}")
    seq = q.array.shape[0]
    _check_seq(seq)
    if k.array.shape[0] != seq or v.array.shape[0] != seq:
        raise ValueError(f"q, k and v must have the same number of tokens: {seq}, {k.array.shape[0]}, {v.array.shape[0]}")
    pos_arr = _pos_array(pos, seq, max_seq)
    dst_rows = seq if form == "functional" else max_seq
    dims = _int32((seq, n_heads, n_kv_heads, dst_rows, q.stride, q.offset, k.stride, k.offset,
                   v.stride, v.offset))
    inputs = [q.array, k.array, v.array]
    constants = dict(D=head_dim, NEOX=neox, FREQ_TABLE=freqs == "table" or inv_freq is not None)
    scalars = (theta, freq_scale)
    if norm is not None:
        q_weight, k_weight, eps = norm
        for name, w in (("q_norm", q_weight), ("k_norm", k_weight)):
            if w.dtype != mx.float32 or w.shape != (head_dim,):
                raise ValueError(f"{name} must be float32[{head_dim}], got {w.dtype}{w.shape}")
        inputs += [q_weight, k_weight]
        scalars += (float(eps),)
        spec = _kv_spec("rope/head_norm_rope_kv_write.metal", form, True)
        grid, tg = (head_dim // 2, n_heads, seq), (head_dim // 2, 1, 1)
    else:
        spec = _kv_spec("rope/rope_kv_write.metal", form, False)
        hpt = _heads_per_thread(seq)
        constants["HPT"] = hpt
        grid, tg = _geometry(head_dim // 4, -(-(n_heads + 2 * n_kv_heads) // hpt), seq)
    inputs += [pos_arr, _table(head_dim, theta, inv_freq), _float32(scalars), dims]
    q_shape = ((seq, n_heads, head_dim), mx.float16)
    if form == "functional":
        rows = ((n_kv_heads, seq, head_dim), mx.float16)
        q_out, k_rows, v_rows = launch(Launch(spec, inputs, [q_shape, rows, rows], grid, tg, constants))
        return Rotated(
            q_out,
            mx.slice_update(k_cache, k_rows, pos_arr, axes=(1,)),
            mx.slice_update(v_cache, v_rows, pos_arr, axes=(1,)),
        )
    inputs += [k_cache, v_cache]
    q_out, written = launch(Launch(spec, inputs, [q_shape, ((1,), mx.uint32)], grid, tg, constants))
    k_cache, v_cache = depends([k_cache, v_cache], [written])
    return Rotated(q_out, k_cache, v_cache, written)


def rope_qkv_write(qkv, k_cache, v_cache, pos, *, n_heads, theta=10000.0, freq_scale=1.0,
                   freqs="table", inv_freq=None, form="in_place", neox=False) -> Rotated:
    """Decode: qkv[(n_heads + 2 n_kv) * D] (one token, Q then K then V heads): Q rotated, K rotated
    into the cache at row pos, V copied there. n_kv_heads and D come from the cache shape."""
    n_kv, head_dim = _cache_heads(k_cache)
    _check_heads(n_heads, n_kv)
    _check_head_dim(head_dim, multiple=4)
    q, k, v = _fused_qkv(qkv, n_heads, n_kv, head_dim)
    return _kv_write(q, k, v, k_cache, v_cache, pos, n_heads=n_heads, head_dim=head_dim, neox=neox,
                     theta=theta, freq_scale=freq_scale, freqs=freqs, inv_freq=inv_freq, form=form)


def rope_neox_qkv_write(qkv, k_cache, v_cache, pos, **kw) -> Rotated:
    """rope_qkv_write with NeoX pairs."""
    return rope_qkv_write(qkv, k_cache, v_cache, pos, neox=True, **kw)


def rope_batch_kv_write(q, k, v, k_cache, v_cache, pos, *, theta=10000.0, freq_scale=1.0,
                        freqs="table", inv_freq=None, form="in_place", neox=False) -> Rotated:
    """Prefill: q[seq, n_heads * D], k and v [seq, n_kv * D] (or [seq, heads, D]) at positions
    pos .. pos+seq-1; rotated K and V written into cache rows pos .. pos+seq-1."""
    rows, n_heads, head_dim = _separate_qkv(q, k, v, k_cache, head_dim_multiple=4)
    return _kv_write(*rows, k_cache, v_cache, pos, n_heads=n_heads, head_dim=head_dim, neox=neox,
                     theta=theta, freq_scale=freq_scale, freqs=freqs, inv_freq=inv_freq, form=form)


def rope_neox_batch_kv_write(q, k, v, k_cache, v_cache, pos, **kw) -> Rotated:
    """rope_batch_kv_write with NeoX pairs."""
    return rope_batch_kv_write(q, k, v, k_cache, v_cache, pos, neox=True, **kw)


def head_norm_rope_neox_kv_write(q, k, v, q_norm, k_norm, k_cache, v_cache, pos, *, eps=1e-6,
                                 theta=1000000.0, freq_scale=1.0, freqs="table", inv_freq=None,
                                 form="in_place") -> Rotated:
    """Qwen3: per-head RMSNorm of Q and K (float32 weights q_norm, k_norm [D]), NeoX RoPE and the
    KV write in one dispatch. q[seq, n_heads * D], k and v [seq, n_kv * D] (or [seq, heads, D])."""
    # D/2 threads per head must fill whole SIMD groups: D a multiple of 64.
    rows, n_heads, head_dim = _separate_qkv(q, k, v, k_cache, head_dim_multiple=64)
    return _kv_write(*rows, k_cache, v_cache, pos, n_heads=n_heads, head_dim=head_dim, neox=True,
                     theta=theta, freq_scale=freq_scale, freqs=freqs, inv_freq=inv_freq, form=form,
                     norm=(q_norm, k_norm, eps))


def head_norm_rope_neox_qkv_write(qkv, q_norm, k_norm, k_cache, v_cache, pos, *, n_heads, eps=1e-6,
                                  theta=1000000.0, freq_scale=1.0, freqs="table", inv_freq=None,
                                  form="in_place") -> Rotated:
    """head_norm_rope_neox_kv_write reading Q, K and V where a fused QKV projection left them:
    qkv[seq, (n_heads + 2 n_kv) * D] (no slices, no copies)."""
    n_kv, head_dim = _cache_heads(k_cache)
    _check_heads(n_heads, n_kv)
    _check_head_dim(head_dim, multiple=64)
    q, k, v = _fused_qkv(qkv, n_heads, n_kv, head_dim)
    return _kv_write(q, k, v, k_cache, v_cache, pos, n_heads=n_heads, head_dim=head_dim, neox=True,
                     theta=theta, freq_scale=freq_scale, freqs=freqs, inv_freq=inv_freq, form=form,
                     norm=(q_norm, k_norm, eps))


def _separate_qkv(q, k, v, k_cache, head_dim_multiple: int) -> tuple[tuple[_Rows, _Rows, _Rows], int, int]:
    """Separate q[seq, n_heads * D], k and v [seq, n_kv * D] (or [seq, heads, D]), checked against
    the cache's head count and head_dim: ((q, k, v) rows, n_heads, head_dim)."""
    n_kv, head_dim = _cache_heads(k_cache)
    _check_head_dim(head_dim, multiple=head_dim_multiple)
    n_heads = _head_count("q", q, head_dim)
    _check_heads(n_heads, n_kv)
    seq = q.shape[0]
    rows = (_separate("q", q, n_heads, head_dim, seq), _separate("k", k, n_kv, head_dim, seq),
            _separate("v", v, n_kv, head_dim, seq))
    return rows, n_heads, head_dim


def _cache_heads(k_cache: mx.array) -> tuple[int, int]:
    _check_fp16("k_cache", k_cache)
    if k_cache.ndim != 3:
        raise ValueError(f"k_cache must be [n_kv_heads, max_seq, head_dim], got {tuple(k_cache.shape)}")
    return k_cache.shape[0], k_cache.shape[2]


def _head_count(name: str, a: mx.array, head_dim: int) -> int:
    _check_fp16(name, a)
    if a.ndim == 3:
        if a.shape[2] != head_dim:
            raise ValueError(f"{name} has head_dim {a.shape[2]} but the cache has {head_dim}")
        return a.shape[1]
    if a.ndim != 2 or a.shape[1] % head_dim:
        raise ValueError(f"{name} must be [seq, heads * {head_dim}], got {tuple(a.shape)}")
    return a.shape[1] // head_dim


# ---- unfused path pieces -------------------------------------------------------------------------
_CACHE_WRITE = KernelSpec(
    name="lathe_cache_write",
    body="rope/cache_write.metal",
    inputs=("src", "pos", "dims", *cache_io("in_place", ("kv",))[0]),
    outputs=cache_io("in_place", ("kv",))[1],
    prelude=cache_prelude("in_place", ("kv",)),
    in_place=cache_io("in_place", ("kv",))[0],
)


def cache_write(rows: mx.array, cache: mx.array, pos: int | mx.array) -> tuple[mx.array, mx.array]:
    """In-place write of rows[seq, n_kv * D] (or [seq, n_kv, D]) into cache rows pos .. pos+seq-1
    (the unfused path's K write and V write). Returns (cache wrapped by mx.depends, ordering
    token): GPU readers take the token as an input, as for `Rotated.written`."""
    n_kv, head_dim = _cache_heads(cache)
    _check_head_dim(head_dim)
    max_seq = _check_cache("cache", cache, n_kv, head_dim)
    src = _separate("rows", rows, n_kv, head_dim, None)
    seq = src.array.shape[0]
    _check_seq(seq)
    pos_arr = _pos_array(pos, seq, max_seq)
    (written,) = launch(
        Launch(_CACHE_WRITE, [src.array, pos_arr, _int32((seq, n_kv, max_seq, src.stride, src.offset)), cache],
               [((1,), mx.uint32)], (head_dim // 2, n_kv, seq),
               (head_dim // 2, max(1, min(n_kv, TUNING["threads"] // (head_dim // 2))), 1),
               {"D": head_dim})
    )
    return depends(cache, [written]), written


_CACHE_READ = KernelSpec(
    name="lathe_cache_read",
    body="rope/cache_read.metal",
    inputs=("cache", "after", "dims"),
    outputs=("rows",),
)


def cache_read(cache: mx.array, start: int, n: int, after: mx.array) -> mx.array:
    """Rows start .. start+n-1 of a head-major cache, as [n_kv, n, D]: a GPU reader ordered after
    the in-place writes whose token (or tokens, concatenated) is `after`."""
    n_kv, head_dim = _cache_heads(cache)
    max_seq = cache.shape[1]
    if start < 0 or n < 1 or start + n > max_seq:
        raise ValueError(f"rows {start}..{start + n - 1} are outside a cache of {max_seq}")
    (rows,) = launch(Launch(_CACHE_READ, [cache, after, _int32((start, n, max_seq))],
                            [((n_kv, n, head_dim), mx.float16)], (head_dim, n, n_kv),
                            (head_dim, 1, 1), {"D": head_dim}))
    return rows


_HEAD_RMSNORM = KernelSpec(
    name="lathe_head_rmsnorm",
    body="rope/head_rmsnorm.metal",
    inputs=("x", "weight", "scalars"),
    outputs=("out",),
    threadgroup_bytes=lambda c: 4 * ((c["D"] // 2 + 31) // 32),  # a sum a SIMD group of D/2 threads
)


def head_rmsnorm(x: mx.array, weight: mx.array, eps: float = 1e-6) -> mx.array:
    """RMSNorm of every head: x[..., D] with float32 weight[D] (the unfused Q and K norms)."""
    _check_fp16("x", x)
    head_dim = x.shape[-1]
    _check_head_dim(head_dim, multiple=64)
    if weight.dtype != mx.float32 or weight.shape != (head_dim,):
        raise ValueError(f"weight must be float32[{head_dim}], got {weight.dtype}{weight.shape}")
    _check_size("x", x.size)
    rows = x.size // head_dim
    (out,) = launch(
        Launch(_HEAD_RMSNORM, [x, weight, _float32((float(eps),))], [(x.shape, mx.float16)],
               (rows * head_dim // 2, 1, 1), (head_dim // 2, 1, 1), {"D": head_dim})
    )
    return out
