"""A decoder layer's two halves as one launch each (the seeds' mega-kernels), for decode tokens:

- `attention_block(x, ...)`: RMSNorm + QKV GEMV, (Qwen3: per-head RMSNorm of Q and K), RoPE, the
  KV-cache write, grouped-query decode attention, the output projection and the residual add
  (blocks/attention_block.metal).
- `ffn_block(x, ...)`: RMSNorm + gate|up GEMV with SiLU in its epilogue, the down GEMV and the
  residual add (blocks/ffn_block.metal).

Each phase is the kernel that runs it on its own (the v3 GEMV rows, decode attention's rows),
entered through the seam's tickets: threadgroups claim work from one counter in phase order and
wait only on work claimed before theirs, so no launch size can deadlock. That needs a running
threadgroup to keep being scheduled while others spin on a counter: NVIDIA GPUs give it to
resident blocks in practice; Metal documents no forward progress between the threadgroups of a
dispatch and its device atomics are relaxed only. `cross_group_waits()` is the one place that
decides: where it is False (Metal) each block runs its phases as the separate launches that the
fused decode variant makes (same results, no waits between threadgroups).

Weights are repacked (kernels.gemv.Packed, the v3 layout): the decode loop's default.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from kernels import attention, gemv, options, rope
from kernels.gemv import Packed
from kernels.runtime import KernelSpec, Launch, constant, launch, resident, target_backend

QUEUE_STRIDE = 64  # words between a block's counters: each on a 256-byte line of its own
ATTENTION_QUEUE = 4 * QUEUE_STRIDE  # claimed, QKV done, attention done, threadgroups out
FFN_QUEUE = 3 * QUEUE_STRIDE  # claimed, gate+up done, threadgroups out


def cross_group_waits() -> bool:
    """Whether a launch may have threadgroups wait on the work of others (the blocks as one
    launch each): on CUDA, where resident blocks keep running while others spin. Not on Metal
    (no forward-progress promise between threadgroups; the phases run as separate launches).
    Recorded launches on a machine without a GPU are CUDA's (kernels.runtime.target_backend)."""
    return target_backend() == "cuda"


def attention_queue() -> mx.array:
    """The counters of one attention_block launch site: zero, on the device; a launch leaves
    them zero. Two launches in flight at once must not share them (the decode loop gives each
    layer its own)."""
    return resident(mx.zeros((ATTENTION_QUEUE,), mx.uint32))


def ffn_queue() -> mx.array:
    """The counters of one ffn_block launch site (as attention_queue)."""
    return resident(mx.zeros((FFN_QUEUE,), mx.uint32))


@functools.cache
def _attention_spec(split: bool, head_norm: bool) -> KernelSpec:
    inputs = ("x_in", "attn_norm", "eps", "w_qkv", "qkv_dims", "k_cache", "v_cache", "pos", "inv_freq",
              "rope_scalars", "dims", "scale") + (("q_norm", "k_norm") if head_norm else ()) + (
        ("counters",) if split else ()) + ("w_o", "o_dims", "block_dims", "queue")
    outputs = ("qkv", "attn_out", "x_out") + (("part_out", "part_ml") if split else ())
    return KernelSpec(f"lathe_attention_block{'_norm' if head_norm else ''}{'_split' if split else ''}",
                      "blocks/attention_block.metal", inputs, outputs,
                      prelude=f"#define LATHE_PAGED 0\n#define LATHE_ROPE 1\n#define LATHE_SPLIT {int(split)}\n"
                              f"#define LATHE_MERGE {int(split)}\n#define LATHE_HEAD_NORM {int(head_norm)}")


_FFN_SPEC = KernelSpec("lathe_ffn_block", "blocks/ffn_block.metal",
                       ("x_in", "ffn_norm", "eps", "w_gate_up", "up_dims", "w_down", "down_dims", "block_dims",
                        "queue"), ("act", "x_out"))


def _check_queue(queue: mx.array, size: int, maker: str) -> None:
    if not isinstance(queue, mx.array) or queue.dtype != mx.uint32 or queue.shape != (size,):
        raise ValueError(f"queue must be uint32 [{size}] ({maker}()), got "
                         f"{getattr(queue, 'dtype', type(queue))} {getattr(queue, 'shape', '')}")


def _packed(name: str, w, qtype: str, n: int, k: int) -> None:
    if not isinstance(w, Packed):
        raise ValueError(f"{name} must be repacked weights (kernels.gemv.repack), got {type(w).__name__}")
    gemv._check_packed(w, qtype, n, k)


def geometry(qtype: str, m: int, gemvs: tuple[tuple[int, int], ...], even_rows: bool = False
             ) -> tuple[int, int, int, int]:
    """(R, NSIMD, P, XCHUNK) shared by a block's GEMVs (one set of threadgroup memory): the first
    GEMV's own v3 geometry (R made even for a SwiGLU epilogue), X' chunks sized for the longest K."""
    n, k = gemvs[0]
    r, s, p, _ = gemv.v3_geometry(qtype, m, n, k)
    if even_rows and r % 2:
        r += 1
    _, _, _, xchunk = gemv.v3_geometry(qtype, m, 1, max(k for _, k in gemvs), r, s, p)
    return r, s, p, xchunk


def _tickets(n: int, k: int, r: int, s: int, xchunk: int, rows_per_output: int = 1) -> int:
    """Threadgroups of one of a block's GEMVs: one per NSIMD row groups, capped by shape (as a v3
    launch of its own) where all of K is one chunk of X'."""
    groups = -(-n // (r * s))
    cap = gemv.TUNING["V3_MAX_GROUPS"] or gemv.v3_by_shape(n * rows_per_output, k)["G"]
    return min(groups, cap) if cap and xchunk >= k else groups


def attention_block(x: mx.array, attn_norm: mx.array, eps: float, w_qkv: Packed, w_o: Packed, qtype: str,
                    k_cache: mx.array, v_cache: mx.array, pos: int | mx.array, *, n_heads: int,
                    theta: float = 10000.0, neox: bool = False, q_norm: mx.array | None = None,
                    k_norm: mx.array | None = None, queue: mx.array | None = None,
                    counters: mx.array | None = None, split_from: int = attention.SPLIT_FROM,
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """One decode token's attention half of a layer: x [1, d_model] (the residual stream) ->
    (x + Attention(RoPE(RMSNorm(x) W_qkv^T)) W_o^T, k_cache, v_cache), K and V of the token
    written at row pos of the head-major caches [n_kv, max_seq, D] (in place; the returned
    caches are ordered after the write). q_norm, k_norm (f32[D]): Qwen3's head norms (eps is
    then theirs too). pos: an int (checked) or int32[1] on the device (a compiled step: the
    attention's grid is sized for max_seq). queue / counters: the launch site's (attention_queue,
    attention.merge_counters); fresh ones when not given."""
    if k_cache.ndim != 3 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"k_cache and v_cache must both be [Hkv, max_seq, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    attention._fp16("k_cache", k_cache)
    attention._fp16("v_cache", v_cache)
    n_kv, max_seq, head_dim = k_cache.shape
    d_model = x.shape[-1]
    n_qkv = (n_heads + 2 * n_kv) * head_dim
    gemv.check_gemv_args(x, w_qkv, qtype, n_qkv, d_model, max_m=1)
    _packed("w_qkv", w_qkv, qtype, n_qkv, d_model)
    _packed("w_o", w_o, qtype, d_model, n_heads * head_dim)
    gemv._check_norm(attn_norm, eps, d_model)
    head_norm = q_norm is not None or k_norm is not None
    if not cross_group_waits():
        return _attention_apart(x, attn_norm, eps, w_qkv, w_o, qtype, k_cache, v_cache, pos, n_heads, theta,
                                neox, q_norm, k_norm, counters, split_from)
    norms = attention._head_norms(q_norm, k_norm, eps if head_norm else None, head_dim)
    if n_heads < n_kv or n_heads % n_kv:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of the cache's {n_kv} kv heads")
    if head_dim not in attention.HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {attention.HEAD_DIMS}, got {head_dim}")
    queue = attention_queue() if queue is None else queue
    _check_queue(queue, ATTENTION_QUEUE, "attention_queue")
    pos_arr = rope._pos_array(pos, 1, max_seq)

    r, s, p, xchunk = geometry(qtype, 1, ((n_qkv, d_model), (d_model, n_heads * head_dim)))
    qkv_tickets = _tickets(n_qkv, d_model, r, s, xchunk)
    o_tickets = -(-d_model // (r * s))  # threadgroup g runs group g: no cap
    # The attention's partitions as flash_decode would split them (the grid sized for the
    # longest context a call can see), merged in the launch: at most MERGE_PARTS partitions.
    longest = pos + 1 if isinstance(pos, int) else max_seq
    group = n_heads // n_kv
    partition = options.get("attn_partition") or attention.auto_partition(longest, n_kv)
    chunk = s * 32  # decode_rows' tokens a chunk at this NSIMD
    partition = max(-(-partition // chunk) * chunk, -(-longest // (attention.MERGE_PARTS * chunk)) * chunk)
    split = longest > partition and longest > split_from
    parts = -(-longest // partition) if split else 1
    qs = attention.query_split(group, n_kv * parts)
    attn_tickets = parts * n_kv * qs
    launched = max(qkv_tickets, o_tickets)
    inputs = [x, attn_norm, gemv._eps(float(eps)), w_qkv.data, gemv._dims(n_qkv, d_model, qkv_tickets),
              k_cache, v_cache, pos_arr, rope._table(head_dim, theta, None),
              constant((float(theta), 1.0, float(eps)), mx.float32),
              constant((n_kv, max_seq, partition, parts, 1)), constant((1.0 / math.sqrt(head_dim),), mx.float32),
              *norms]
    if split:
        counters = attention.merge_counters(n_kv * qs) if counters is None else counters
        attention._check_counters(counters, n_kv * qs)
        inputs.append(counters)
    inputs += [w_o.data, gemv._dims(d_model, n_heads * head_dim, o_tickets), constant((launched, attn_tickets)),
               queue]
    outputs = [((1, n_qkv), mx.float16), ((1, n_heads, head_dim), mx.float16), ((1, d_model), mx.float16)]
    if split:
        outputs += [((1, n_heads, parts, head_dim), mx.float32), ((1, n_heads, parts, 2), mx.float32)]
    consts = dict(QTYPE=gemv.QTYPES[qtype][0], M=1, R=r, NSIMD=s, P=p, XCHUNK=xchunk, K_QKV=d_model,
                  K_O=n_heads * head_dim, D=head_dim, G=group // qs, QS=qs, BS=0, NEOX=neox, FREQ_TABLE=True)
    res = launch(Launch(_attention_spec(split, bool(norms)), inputs, outputs,
                        (launched * 32 * s, 1, 1), (32 * s, 1, 1), consts))
    x_out = res[2]
    k_cache, v_cache = mx.depends([k_cache, v_cache], [x_out])
    return x_out, k_cache, v_cache


def _attention_apart(x, attn_norm, eps, w_qkv, w_o, qtype, k_cache, v_cache, pos, n_heads, theta, neox,
                     q_norm, k_norm, counters, split_from):
    """attention_block's phases as three launches (Metal: no waits between threadgroups)."""
    n_kv, _, head_dim = k_cache.shape
    d_model = x.shape[-1]
    qkv = gemv.rmsnorm_gemv(x, attn_norm, eps, w_qkv, qtype, (n_heads + 2 * n_kv) * head_dim, d_model)
    head_norm = q_norm is not None or k_norm is not None
    o, k_cache, v_cache = attention.rope_flash_decode(
        qkv, k_cache, v_cache, pos, 1.0 / math.sqrt(head_dim), n_heads=n_heads, theta=theta, neox=neox,
        counters=counters, split_from=split_from, q_norm=q_norm, k_norm=k_norm, eps=eps if head_norm else None)
    return gemv.gemv_v3(o.reshape(1, -1), w_o, qtype, d_model, n_heads * head_dim, residual=x), k_cache, v_cache


def ffn_block(x: mx.array, ffn_norm: mx.array, eps: float, w_gate_up: Packed, w_down: Packed, qtype: str, *,
              queue: mx.array | None = None) -> mx.array:
    """The FFN half of a layer for M = 1..4 tokens: x [M, d_model] -> x + (silu(X' W_gate^T) *
    (X' W_up^T)) W_down^T, X' = RMSNorm(x) * ffn_norm, W_gate_up = [gate; up] (2F rows) repacked.
    queue: the launch site's (ffn_queue); a fresh one when not given."""
    if not isinstance(w_gate_up, Packed):
        raise ValueError(f"w_gate_up must be repacked weights (kernels.gemv.repack), got {type(w_gate_up).__name__}")
    d_model, n_up = x.shape[-1], w_gate_up.n
    gemv.check_gemv_args(x, w_gate_up, qtype, n_up, d_model)
    _packed("w_gate_up", w_gate_up, qtype, n_up, d_model)
    if n_up % 2:
        raise ValueError(f"w_gate_up must be [gate; up], an even number of rows, got {n_up}")
    f = n_up // 2
    _packed("w_down", w_down, qtype, d_model, f)
    gemv._check_norm(ffn_norm, eps, d_model)
    if not cross_group_waits():
        act = gemv.gate_up_swiglu(x, w_gate_up, qtype, n_up, d_model, gamma=ffn_norm, eps=eps)
        return gemv.gemv_v3(act, w_down, qtype, d_model, f, residual=x)
    queue = ffn_queue() if queue is None else queue
    _check_queue(queue, FFN_QUEUE, "ffn_queue")
    m = x.shape[0]
    r, s, p, xchunk = geometry(qtype, m, ((n_up, d_model), (d_model, f)), even_rows=True)
    up_tickets = _tickets(f, d_model, r // 2, s, xchunk, rows_per_output=2)
    down_tickets = -(-d_model // (r * s))  # threadgroup g runs group g: no cap
    launched = max(up_tickets, down_tickets)
    consts = dict(QTYPE=gemv.QTYPES[qtype][0], M=m, R=r, NSIMD=s, P=p, XCHUNK=xchunk, K_UP=d_model, K_DOWN=f)
    _, x_out = launch(Launch(
        _FFN_SPEC,
        [x, ffn_norm, gemv._eps(float(eps)), w_gate_up.data, gemv._dims(n_up, d_model, up_tickets), w_down.data,
         gemv._dims(d_model, f, down_tickets), constant((launched,)), queue],
        [((m, f), mx.float16), ((m, d_model), mx.float16)], (launched * 32 * s, 1, 1), (32 * s, 1, 1), consts))
    return x_out
