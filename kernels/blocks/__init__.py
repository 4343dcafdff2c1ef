"""A decoder layer's blocks in one launch (the seeds' mega-kernels), for decode tokens:

- `attention_block(x, ...)`: RMSNorm + QKV GEMV, (Qwen3: per-head RMSNorm of Q and K), RoPE, the
  KV-cache write, grouped-query decode attention, the output projection and the residual add.
- `ffn_block(x, ...)`: RMSNorm + gate|up GEMV with SiLU in its epilogue, the down GEMV and the
  residual add.
- `layer_block(x, ...)`: a layer's FFN block, then the next layer's attention block: the decode
  loop's one launch a layer (harness.kernel_decode's megafused variant).

One body, blocks/layer_block.metal, with each half a compile-time switch.

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

QUEUE_STRIDE = 64  # words between a launch's counters: each on a 256-byte line of its own
QUEUE = 6 * QUEUE_STRIDE  # claimed, four phases done, threadgroups out (layer_block.metal)


def cross_group_waits() -> bool:
    """Whether a launch may have threadgroups wait on the work of others (the blocks as one
    launch each): on CUDA, where resident blocks keep running while others spin. Not on Metal
    (no forward-progress promise between threadgroups; the phases run as separate launches).
    Recorded launches on a machine without a GPU are CUDA's (kernels.runtime.target_backend)."""
    return target_backend() == "cuda"


def block_queue() -> mx.array:
    """The counters of one block launch site: zero, on the device; a launch leaves them zero.
    Two launches in flight at once must not share them (the decode loop gives each layer its
    own), and launches that share them must be ordered by their data (mx.depends where nothing
    else orders them)."""
    return resident(mx.zeros((QUEUE,), mx.uint32))


@functools.cache
def _spec(ffn: bool, attn: bool, split: bool = False, head_norm: bool = False) -> KernelSpec:
    inputs, outputs = ("x_in", "eps", "block_dims", "queue"), ()
    if ffn:
        inputs += ("ffn_norm", "w_gate_up", "up_dims", "w_down", "down_dims")
        outputs += ("act", "x_mid")
    if attn:
        inputs += ("attn_norm", "w_qkv", "qkv_dims", "k_cache", "v_cache", "pos", "inv_freq", "rope_scalars", "dims",
                   "scale") + (("q_norm", "k_norm") if head_norm else ()) + (("counters",) if split else ()) + (
            "w_o", "o_dims")
        outputs += ("qkv", "attn_out", "x_out") + (("part_out", "part_ml") if split else ())
    name = {(True, False): "ffn_block", (False, True): "attention_block", (True, True): "layer_block"}[ffn, attn]
    prelude = f"#define FFN {int(ffn)}\n#define ATTN {int(attn)}\n"
    if attn:
        prelude += (f"#define LATHE_PAGED 0\n#define LATHE_ROPE 1\n#define LATHE_SPLIT {int(split)}\n"
                    f"#define LATHE_MERGE {int(split)}\n#define LATHE_HEAD_NORM {int(head_norm)}")
    return KernelSpec(f"lathe_{name}{'_norm' if head_norm else ''}{'_split' if split else ''}",
                      "blocks/layer_block.metal", inputs, outputs, prelude=prelude)


def _check_queue(queue: mx.array) -> None:
    if not isinstance(queue, mx.array) or queue.dtype != mx.uint32 or queue.shape != (QUEUE,):
        raise ValueError(f"queue must be uint32 [{QUEUE}] (block_queue()), got "
                         f"{getattr(queue, 'dtype', type(queue))} {getattr(queue, 'shape', '')}")


def _packed(name: str, w, qtype: str, n: int, k: int) -> None:
    if not isinstance(w, Packed):
        raise ValueError(f"{name} must be repacked weights (kernels.gemv.repack), got {type(w).__name__}")
    gemv._check_packed(w, qtype, n, k)


def geometry(qtype: str, m: int, gemvs: tuple[tuple[int, int], ...], even_rows: bool = False
             ) -> tuple[int, int, int, int]:
    """(R, NSIMD, P, XCHUNK) shared by a launch's GEMVs (one set of threadgroup memory): the first
    GEMV's own v3 geometry (R made even for a SwiGLU epilogue), X' chunks sized for the longest K."""
    n, k = gemvs[0]
    r, s, p, _ = gemv.v3_geometry(qtype, m, n, k)
    if even_rows and r % 2:
        r += 1
    _, _, _, xchunk = gemv.v3_geometry(qtype, m, 1, max(k for _, k in gemvs), r, s, p)
    return r, s, p, xchunk


def _tickets(n: int, k: int, r: int, s: int, xchunk: int, rows_per_output: int = 1) -> int:
    """Threadgroups of a claimed GEMV phase: one per NSIMD row groups, capped by shape (as a v3
    launch of its own) where all of K is one chunk of X'."""
    groups = -(-n // (r * s))
    cap = gemv.TUNING["V3_MAX_GROUPS"] or gemv.v3_by_shape(n * rows_per_output, k)["G"]
    return min(groups, cap) if cap and xchunk >= k else groups


class _FFN:
    """The FFN half's arguments, checked."""

    def __init__(self, x, ffn_norm, eps, w_gate_up, w_down, qtype):
        if not isinstance(w_gate_up, Packed):
            raise ValueError(f"w_gate_up must be repacked weights (kernels.gemv.repack), got {type(w_gate_up).__name__}")
        d_model, n_up = x.shape[-1], w_gate_up.n
        gemv.check_gemv_args(x, w_gate_up, qtype, n_up, d_model)
        _packed("w_gate_up", w_gate_up, qtype, n_up, d_model)
        if n_up % 2:
            raise ValueError(f"w_gate_up must be [gate; up], an even number of rows, got {n_up}")
        _packed("w_down", w_down, qtype, d_model, n_up // 2)
        gemv._check_norm(ffn_norm, eps, d_model)
        self.norm, self.w_gate_up, self.w_down, self.d, self.f = ffn_norm, w_gate_up, w_down, d_model, n_up // 2


class _Attention:
    """The attention half's arguments, checked."""

    def __init__(self, x, attn_norm, eps, w_qkv, w_o, qtype, k_cache, v_cache, pos, n_heads, theta, neox, q_norm,
                 k_norm, counters, split_from):
        attention._fp16("k_cache", k_cache)
        attention._fp16("v_cache", v_cache)
        if k_cache.ndim != 3 or tuple(v_cache.shape) != tuple(k_cache.shape):
            raise ValueError(f"k_cache and v_cache must both be [Hkv, max_seq, D], got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        n_kv, max_seq, head_dim = k_cache.shape
        if head_dim not in attention.HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {attention.HEAD_DIMS}, got {head_dim}")
        if n_heads < n_kv or n_heads % n_kv:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of the cache's {n_kv} kv heads")
        d_model = x.shape[-1]
        n_qkv = (n_heads + 2 * n_kv) * head_dim
        gemv.check_gemv_args(x, w_qkv, qtype, n_qkv, d_model, max_m=1)
        _packed("w_qkv", w_qkv, qtype, n_qkv, d_model)
        _packed("w_o", w_o, qtype, d_model, n_heads * head_dim)
        gemv._check_norm(attn_norm, eps, d_model)
        head_norm = q_norm is not None or k_norm is not None
        self.norms = attention._head_norms(q_norm, k_norm, eps if head_norm else None, head_dim)
        self.pos = rope._pos_array(pos, 1, max_seq)
        self.__dict__.update(norm=attn_norm, w_qkv=w_qkv, w_o=w_o, k_cache=k_cache, v_cache=v_cache, n_heads=n_heads,
                             n_kv=n_kv, head_dim=head_dim, theta=theta, neox=neox, counters=counters, d=d_model,
                             n_qkv=n_qkv, q_norm=q_norm, k_norm=k_norm, split_from=split_from,
                             longest=pos + 1 if isinstance(pos, int) else max_seq, max_seq=max_seq, raw_pos=pos)


def _launch(x: mx.array, eps: float, qtype: str, ffn: _FFN | None, attn: _Attention | None,
            queue: mx.array | None) -> list[mx.array]:
    """layer_block.metal over the halves given: its outputs in the spec's order."""
    queue = block_queue() if queue is None else queue
    _check_queue(queue)
    m = x.shape[0]
    gemvs = (((2 * ffn.f, ffn.d), (ffn.d, ffn.f)) if ffn else ()) + (
        ((attn.n_qkv, attn.d), (attn.d, attn.n_heads * attn.head_dim)) if attn else ())
    r, s, p, xchunk = geometry(qtype, m, gemvs, even_rows=ffn is not None)
    inputs, consts = [], dict(QTYPE=gemv.QTYPES[qtype][0], M=m, R=r, NSIMD=s, P=p, XCHUNK=xchunk)
    outputs: list = []
    launched, attn_tickets, split = 1, 0, False
    if ffn:
        up = _tickets(ffn.f, ffn.d, r // 2, s, xchunk, rows_per_output=2)
        # down: claimed where attention follows (capped as a launch of its own), else the last
        # phase, threadgroup g its group g (no cap)
        down = _tickets(ffn.d, ffn.f, r, s, xchunk) if attn else -(-ffn.d // (r * s))
        launched = max(launched, up, 0 if attn else down)
        inputs += [ffn.norm, ffn.w_gate_up.data, gemv._dims(2 * ffn.f, ffn.d, up), ffn.w_down.data,
                   gemv._dims(ffn.d, ffn.f, down)]
        outputs += [((m, ffn.f), mx.float16), ((m, ffn.d), mx.float16)]
        consts.update(K_UP=ffn.d, K_DOWN=ffn.f)
    if attn:
        a = attn
        qkv_tickets = _tickets(a.n_qkv, a.d, r, s, xchunk)
        o_groups = -(-a.d // (r * s))  # the last phase: threadgroup g runs group g, no cap
        # The attention's partitions as flash_decode would split them (the grid sized for the
        # longest context a call can see), merged in the launch: at most MERGE_PARTS of them.
        group = a.n_heads // a.n_kv
        chunk = s * 32  # decode_rows' tokens a chunk at this NSIMD
        partition = options.get("attn_partition") or attention.auto_partition(a.longest, a.n_kv)
        partition = max(-(-partition // chunk) * chunk, -(-a.longest // (attention.MERGE_PARTS * chunk)) * chunk)
        split = a.longest > partition and a.longest > a.split_from
        parts = -(-a.longest // partition) if split else 1
        qs = attention.query_split(group, a.n_kv * parts)
        attn_tickets = parts * a.n_kv * qs
        launched = max(launched, qkv_tickets, o_groups)
        inputs += [a.norm, a.w_qkv.data, gemv._dims(a.n_qkv, a.d, qkv_tickets), a.k_cache, a.v_cache, a.pos,
                   rope._table(a.head_dim, a.theta, None), constant((float(a.theta), 1.0, float(eps)), mx.float32),
                   constant((a.n_kv, a.max_seq, partition, parts, 1)),
                   constant((1.0 / math.sqrt(a.head_dim),), mx.float32), *a.norms]
        if split:
            counters = attention.merge_counters(a.n_kv * qs) if a.counters is None else a.counters
            attention._check_counters(counters, a.n_kv * qs)
            inputs.append(counters)
        inputs += [a.w_o.data, gemv._dims(a.d, a.n_heads * a.head_dim, o_groups)]
        outputs += [((1, a.n_qkv), mx.float16), ((1, a.n_heads, a.head_dim), mx.float16), ((1, a.d), mx.float16)]
        if split:
            outputs += [((1, a.n_heads, parts, a.head_dim), mx.float32), ((1, a.n_heads, parts, 2), mx.float32)]
        consts.update(K_QKV=a.d, K_O=a.n_heads * a.head_dim, D=a.head_dim, G=group // qs, QS=qs, BS=0,
                      NEOX=a.neox, FREQ_TABLE=True)
    inputs = [x, gemv._eps(float(eps)), constant((launched, attn_tickets)), queue] + inputs
    return launch(Launch(_spec(ffn is not None, attn is not None, split, bool(attn and attn.norms)), inputs,
                         outputs, (launched * 32 * s, 1, 1), (32 * s, 1, 1), consts))


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
    attention's grid is sized for max_seq). queue / counters: the launch site's (block_queue,
    attention.merge_counters); fresh ones when not given."""
    attn = _Attention(x, attn_norm, eps, w_qkv, w_o, qtype, k_cache, v_cache, pos, n_heads, theta, neox, q_norm,
                      k_norm, counters, split_from)
    if not cross_group_waits():
        return _attention_apart(x, eps, qtype, attn)
    x_out = _launch(x, eps, qtype, None, attn, queue)[2]
    k_cache, v_cache = mx.depends([k_cache, v_cache], [x_out])
    return x_out, k_cache, v_cache


def ffn_block(x: mx.array, ffn_norm: mx.array, eps: float, w_gate_up: Packed, w_down: Packed, qtype: str, *,
              queue: mx.array | None = None) -> mx.array:
    """The FFN half of a layer for M = 1..4 tokens: x [M, d_model] -> x + (silu(X' W_gate^T) *
    (X' W_up^T)) W_down^T, X' = RMSNorm(x) * ffn_norm, W_gate_up = [gate; up] (2F rows) repacked.
    queue: the launch site's (block_queue); a fresh one when not given."""
    ffn = _FFN(x, ffn_norm, eps, w_gate_up, w_down, qtype)
    if not cross_group_waits():
        return _ffn_apart(x, eps, qtype, ffn)
    return _launch(x, eps, qtype, ffn, None, queue)[1]


def layer_block(x: mx.array, ffn_norm: mx.array, w_gate_up: Packed, w_down: Packed, attn_norm: mx.array,
                w_qkv: Packed, w_o: Packed, eps: float, qtype: str, k_cache: mx.array, v_cache: mx.array,
                pos: int | mx.array, *, n_heads: int, theta: float = 10000.0, neox: bool = False,
                q_norm: mx.array | None = None, k_norm: mx.array | None = None, queue: mx.array | None = None,
                counters: mx.array | None = None, split_from: int = attention.SPLIT_FROM,
                ) -> tuple[mx.array, mx.array, mx.array]:
    """A layer's FFN block, then the next layer's attention block, in one launch for one decode
    token: ffn_block's arguments (ffn_norm, w_gate_up, w_down), then attention_block's over its
    output (the caches and head norms are the next layer's). Returns attention_block's."""
    ffn = _FFN(x, ffn_norm, eps, w_gate_up, w_down, qtype)
    attn = _Attention(x, attn_norm, eps, w_qkv, w_o, qtype, k_cache, v_cache, pos, n_heads, theta, neox, q_norm,
                      k_norm, counters, split_from)
    if x.shape[0] != 1:
        raise ValueError(f"layer_block takes one token (x [1, d_model]), got {tuple(x.shape)}")
    if not cross_group_waits():
        return _attention_apart(_ffn_apart(x, eps, qtype, ffn), eps, qtype, attn)
    x_out = _launch(x, eps, qtype, ffn, attn, queue)[4]
    k_cache, v_cache = mx.depends([k_cache, v_cache], [x_out])
    return x_out, k_cache, v_cache


def _attention_apart(x: mx.array, eps: float, qtype: str, a: _Attention) -> tuple[mx.array, mx.array, mx.array]:
    """attention_block's phases as separate launches (Metal: no waits between threadgroups)."""
    qkv = gemv.rmsnorm_gemv(x, a.norm, eps, a.w_qkv, qtype, a.n_qkv, a.d)
    head_norm = a.q_norm is not None
    o, k_cache, v_cache = attention.rope_flash_decode(
        qkv, a.k_cache, a.v_cache, a.raw_pos, 1.0 / math.sqrt(a.head_dim), n_heads=a.n_heads, theta=a.theta,
        neox=a.neox, counters=a.counters, split_from=a.split_from, q_norm=a.q_norm, k_norm=a.k_norm,
        eps=eps if head_norm else None)
    x_out = gemv.gemv_v3(o.reshape(1, -1), a.w_o, qtype, a.d, a.n_heads * a.head_dim, residual=x)
    return x_out, k_cache, v_cache


def _ffn_apart(x: mx.array, eps: float, qtype: str, f: _FFN) -> mx.array:
    """ffn_block's phases as separate launches (Metal)."""
    act = gemv.gate_up_swiglu(x, f.w_gate_up, qtype, 2 * f.f, f.d, gamma=f.norm, eps=eps)
    return gemv.gemv_v3(act, f.w_down, qtype, f.d, f.f, residual=x)
