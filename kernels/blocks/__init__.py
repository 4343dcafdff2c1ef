"""A decoder layer's blocks in one launch (the seeds' mega-kernels), for decode tokens:

- `attention_block(x, ...)`: RMSNorm + QKV GEMV, (Qwen3: per-head RMSNorm of Q and K), RoPE, the
  KV-cache write, grouped-query decode attention, the output projection and the residual add.
- `ffn_block(x, ...)`: RMSNorm + gate|up GEMV with SiLU in its epilogue, the down GEMV and the
  residual add.
- `layer_block(x, ...)`: a layer's FFN block, then the next layer's attention block (the megafused
  variant's launch a layer, mega_span=layer).
- `token_block(x, stacks, ...)`: every layer of a decode token in one launch (the seeds'
  persistent kernel; the megafused variant's default, mega_span=token), over LayerStacks: each
  projection's matrices of every layer in one buffer (Stack). Its batch form (a `table`): a decode
  token of each of up to 8 sequences over the paged pool (`lathe serve --variant megafused`). Its
  prompt form (rows, no table): up to 8 tokens of one sequence, causal (option mega_prompt_rows).

One body, blocks/layer_block.metal: a run of phases along a layer's cycle (QKV, attention, O,
gate|up, down) from a compile-time first phase, layers at compile-time strides.

Each phase is the kernel that runs it on its own (the v3 GEMV rows, decode attention's rows),
entered through the seam's tickets: threadgroups claim work from one counter in phase order and
wait only on work claimed before theirs, so no launch size can deadlock. That needs a running
threadgroup to keep being scheduled while others spin on a counter: NVIDIA GPUs give it to
resident blocks in practice; Metal documents no forward progress between the threadgroups of a
dispatch and its device atomics are relaxed only. `kernels.backends.cross_group_waits()` is the one place that
decides: where it is False (Metal) each block runs its phases as the separate launches that the
fused decode variant makes (same results, no waits between threadgroups).

Weights are repacked (kernels.gemv.Packed, the v3 layout): the decode loop's default. Each GEMV
runs in its matrix's block type, which may differ between a launch's GEMVs and, in token_block's
stacks, between layers (llama.cpp's Q4_K_M: some layers' attn_v and ffn_down Q6_K beside Q4_K;
w_v keeps V's rows apart from [q; k] where their type differs; Gemma 3's: Q8_0 beside Q5_0).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels import attention, backends, gemv, loop, options, paged, rope, runtime
from kernels.gemv import Packed
from kernels.runtime import KernelSpec, Launch, constant, depends, launch, resident, resident_groups

# Sequences the batch form takes in one launch: its GEMV phases run v3_rows at M rows (registers
# NVRTC gives the paged module, sm_90: 187-204 at 4 rows, 200-213 at 8, 2 threadgroups an SM either way)
BATCH_ROWS = 8
QUEUE_STRIDE = 64  # words between a launch's counters: each on a 256-byte line of its own
STRIDE_ALIGN = 256  # bytes between layers' matrices in a Stack: every layer's 16-byte loads aligned
QKV, ATTN, O, UP, DOWN = range(5)  # the phase kinds of a layer, in their order (layer_block.metal)
V = 5  # the QKV phase's V rows where they are a matrix of their own (layer_block.metal's QKV_SPLIT)
_KIND_NAMES = {QKV: "QKV", O: "O", UP: "UP", DOWN: "DOWN", V: "V"}  # the kernel's names of a GEMV's constants


BLOCK_COUNTS = 1024  # block_act_codes' counts, a block of 32 act columns each: F up to 32768


def queue_words(phases: int = 5) -> int:
    """Words of the queue of a launch of `phases` phases: claimed, each phase but the last
    done, threadgroups out, a prompt's new K/V rows written, block_act_codes' counts
    (layer_block.metal)."""
    return (phases + 2) * QUEUE_STRIDE + BLOCK_COUNTS


def block_queue(phases: int = 5) -> mx.array:
    """The counters of one block launch site: zero, on the device; a launch leaves them zero.
    `phases`: the most phases a launch on it runs (5 for the blocks of a layer, 5 * layers for
    token_block). Two launches in flight at once must not share them (the decode loop gives each
    site its own), and launches that share them must be ordered by their data."""
    return resident(mx.zeros((queue_words(phases),), mx.uint32))


def _check_types(what: str, qtypes) -> None:
    kinds = sorted(set(qtypes))
    if len(kinds) > 2:
        raise ValueError(f"{what} takes at most two block types (a branch a GEMV: blocks/typed_rows.metal), "
                         f"got {kinds}")


class Stack:
    """The matrices of one projection of every layer (one shape, repacked) in one buffer [layers,
    stride], layer l's bytes at l * stride (the largest matrix padded to STRIDE_ALIGN): what
    token_block reads, each layer at its offset. `layer(l)` is that layer's Packed, a view of the
    same bytes (no copy). The layers may have two block types (llama.cpp's Q4_K_M:
    some layers' attn_v and ffn_down Q6_K, the others Q4_K); `qtypes` has each layer's."""

    def __init__(self, mats: list[Packed]):
        if not mats or any(not isinstance(m, Packed) for m in mats):
            raise ValueError("a Stack takes one or more repacked matrices (kernels.gemv.repack)")
        first = mats[0]
        if any((m.n, m.k) != (first.n, first.k) for m in mats):
            raise ValueError(f"a Stack's matrices share one shape, got {sorted({(m.n, m.k) for m in mats})}")
        _check_types("a Stack", [m.qtype for m in mats])
        self.qtypes, self.n, self.k, self.layers = tuple(m.qtype for m in mats), first.n, first.k, len(mats)
        self.stride = -(-max(m.data.size for m in mats) // STRIDE_ALIGN) * STRIDE_ALIGN
        # [layers, stride]: MLX's dimensions are 32-bit, and a 7-8B model's gate|up of all layers
        # holds more bytes than that (Llama-3-8B Q8_0: 4.0 GB)
        self.data = mx.stack([mx.concatenate([m.data, mx.zeros((self.stride - m.data.size,), mx.uint8)])
                              for m in mats])
        self._views = [Packed(self.data[i, : m.data.size], m.qtype, self.n, self.k) for i, m in enumerate(mats)]
        mx.eval(self.data, [v.data for v in self._views])

    def layer(self, i: int) -> Packed:
        return self._views[i]


@dataclass(frozen=True)
class LayerKind:
    """What token_block's layers compute beyond the llama / qwen3 layer (layer_block.metal's
    POST_NORMS, LAYER_WINDOWS, LATHE_ACT, LATHE_SOFTCAP, QKV_BIAS): Gemma's post-block norms over a
    float32 stream, sliding windows, a GELU-gated FFN, an attention softcap; Qwen2's Q/K/V biases."""

    post_norms: bool = False
    windows: bool = False
    activation: str = "silu"
    softcap: float = 0.0
    qkv_bias: bool = False  # Qwen2's Q, K and V biases, added in the QKV phase (LayerStacks.qkv_bias)


LLAMA = LayerKind()


@functools.cache
def _spec(first: int, phases: int, caches: int = 1, split: bool = False, head_norm: bool = False,
          types: tuple[tuple[int, int, int], ...] = (), kind: LayerKind = LLAMA, paged_kv: bool = False,
          timeline: int = 0, stacked: bool = False, bounds: tuple[int, int] | None = None,
          prompt: bool = False, o_codes: bool = False, act_codes: bool = False) -> KernelSpec:
    """`types`: (kind, type A, type B) of each GEMV (block format codes, layer_block.metal's
    Q_<kind>_A and _B), V among them where the QKV phase's V rows are a matrix of their own;
    `kind`: what the layers compute (token_block's); `paged_kv`: the caches are the paged pool's
    layers, read and written through the input `table` (token_block's batch form); `timeline`:
    each ticket stamped this many times (0: none; 3; TIMELINE_STAMPS: the attention's marks inside)
    into the output `stamps` (BlockTimeline); `stacked`: one K and one V cache
    input holding every layer's [layers, Hkv, max_seq, D] (layer l at l * Hkv * max_seq * D);
    `bounds`: the launch bounds (threads, threadgroups an SM: block_min_groups); `prompt`: the
    prompt form's input `after` (read by nothing: an output of the launch this one must follow);
    `o_codes`: the attention tickets write the O phase's X' (outputs o_codes, o_scales, o_sums:
    layer_block.metal's O_CODES); `act_codes`: the UP phase writes the DOWN phase's (act_codes,
    act_scales, act_sums: ACT_CODES)."""
    kinds = {(first + j) % 5 for j in range(phases)}
    ffn, attn = UP in kinds, QKV in kinds
    qkv_split = any(kind == V for kind, _, _ in types)
    mixed = any(a != b for _, a, b in types)
    inputs, outputs = ("x_in", "eps", "block_dims", "queue"), ()
    if ffn:
        inputs += ("ffn_norm", "w_gate_up", "up_dims", "w_down", "down_dims")
        outputs += ("act", "x_mid")
    if attn:
        inputs += (("attn_norm", "w_qkv", "qkv_dims") + (("w_v", "v_dims") if qkv_split else ())
                   + tuple(f"k_cache_{i}" for i in range(caches))
                   + tuple(f"v_cache_{i}" for i in range(caches)) + ("pos",) + (("table",) if paged_kv else ())
                   + ("inv_freqs", "rope_scalars", "dims", "scale")
                   + (("q_norms", "k_norms") if head_norm else ()) + (("counters",) if split else ()) + ("w_o", "o_dims"))
        outputs += ("qkv", "attn_out", "x_out") + (("part_out", "part_ml") if split else ())
    if mixed:
        inputs += ("layer_types",)
    if kind.post_norms:
        inputs += ("post_attn_norm", "post_ffn_norm")
        outputs += ("blk",)
    if kind.windows:
        inputs += ("windows",)
    if kind.qkv_bias:
        inputs += ("qkv_bias",)
    if prompt:
        inputs += ("after",)
    if o_codes:
        outputs += ("o_codes", "o_scales", "o_sums")
    if act_codes:
        outputs += ("act_codes", "act_scales", "act_sums")
    if timeline:
        outputs += ("stamps",)
    name = {(0, 3): "attention_block", (3, 2): "ffn_block", (3, 5): "layer_block"}.get((first, phases), "token_block")
    prelude = f"#define FFN {int(ffn)}\n#define ATTN {int(attn)}\n#define QKV_SPLIT {int(qkv_split)}\n"
    capped, cap_line = attention._softcap_prelude(kind.softcap)
    prelude += (f"#define POST_NORMS {int(kind.post_norms)}\n#define LAYER_WINDOWS {int(kind.windows)}\n"
                f"#define LATHE_ACT {loop.ACTIVATIONS[kind.activation]}\n{cap_line}\n"
                f"#define QKV_BIAS {int(kind.qkv_bias)}\n"
                f"#define O_CODES {int(o_codes)}\n#define ACT_CODES {int(act_codes)}\n"
                + (f"#define TIMELINE 1\n#define TIMELINE_STAMPS {timeline}\n" if timeline else ""))
    gemma = (("_post" if kind.post_norms else "") + ("_win" if kind.windows else "")
             + ("" if kind.activation == "silu" else f"_{kind.activation}") + capped
             + ("_bias" if kind.qkv_bias else ""))
    prelude += "".join(f"#define Q_{_KIND_NAMES[kind]}_A {a}\n#define Q_{_KIND_NAMES[kind]}_B {b}\n"
                       for kind, a, b in types)
    typed = "_" + "_".join(f"{_KIND_NAMES[kind].lower()}{a}{b if b != a else ''}" for kind, a, b in types)
    if attn:
        # layer l's caches: the only ones, the l-th of the launch's, or layer l of a stack (dims[0]
        # kv heads of dims[1] rows: decode attention's dims)
        for kv in "kv":
            chain = f"{kv}_cache_{caches - 1}"
            for i in reversed(range(caches - 1)):
                chain = f"((l) == {i} ? {kv}_cache_{i} : {chain})"
            if stacked:
                chain = f"({kv}_cache_0 + size_t(l) * uint(dims[0]) * uint(dims[1]) * D)"
            prelude += f"#define LATHE_{kv.upper()}_CACHE(l) {chain}\n"
        prelude += (f"#define LATHE_PAGED {int(paged_kv)}\n#define LATHE_ROPE 1\n#define LATHE_SPLIT {int(split)}\n"
                    f"#define LATHE_MERGE {int(split)}\n#define LATHE_HEAD_NORM {int(head_norm)}")
    layers = "" if name != "token_block" else f"_{phases}"
    return KernelSpec(f"lathe_{name}{layers}{'_paged' if paged_kv else ''}{'_stacked' if stacked else ''}"
                      f"{'_norm' if head_norm else ''}"
                      f"{'_split' if split else ''}{'_ocodes' if o_codes else ''}{'_actcodes' if act_codes else ''}"
                      f"{gemma}{typed}"
                      f"{f'_timeline{timeline}' if timeline else ''}",
                      "blocks/layer_block.metal", inputs, outputs, prelude=prelude,
                      threadgroup_bytes=functools.partial(_threadgroup_bytes, attn=attn, head_norm=head_norm,
                                                          split=split, post_norms=kind.post_norms),
                      in_place=tuple(n for n in inputs if n.startswith(("k_cache_", "v_cache_"))),
                      launch_bounds=bounds)


def _gemv_bytes(m: int, xchunk: int, nsimd: int, rms_late: bool = False) -> int:
    """layer_block.metal's threadgroup memory for its GEMV phases: v3's staged X', the claimed
    ticket and the last-out flag."""
    return gemv.v3_smem_bytes(m, xchunk, nsimd, rms_late) + 8


def _threadgroup_bytes(c: dict, attn: bool, head_norm: bool, split: bool, post_norms: bool = False) -> int:
    """layer_block.metal's threadgroup memory: v3's staged X', the claimed ticket and the
    last-out flag, with post-block norms the float32 stream row (x_post), and with attention
    phases decode attention's arrays (merged partitions where the launch splits; K's slots
    unless they are in X')."""
    gemv_bytes = (_gemv_bytes(c["M"], c["XCHUNK"], c["NSIMD"], bool(c.get("RMS_LATE")))
                  + (4 * c["K_QKV"] if post_norms else 0))
    if not attn:
        return gemv_bytes
    slots = 0 if c.get("KIN_X") else c.get("KSLOTS", 0)  # (KIN_X: the slots are in X')
    return gemv_bytes + attention.decode_threadgroup_bytes(c["G"], c["D"], c["NSIMD"], head_norm,
                                                          attention.merge_held(c) if split else 0, slots,
                                                          bool(c.get("MMA", 0)))


def _check_queue(queue: mx.array, phases: int) -> None:
    need = queue_words(phases)
    if not isinstance(queue, mx.array) or queue.dtype != mx.uint32 or queue.ndim != 1 or queue.size < need:
        raise ValueError(f"queue must be uint32 [>= {need}] (block_queue({phases})), got "
                         f"{getattr(queue, 'dtype', type(queue))} {getattr(queue, 'shape', '')}")


def _packed(name: str, w, n: int, k: int) -> None:
    """w: repacked [n, k] (its own type is the GEMV's: a block's GEMVs may differ in type, as
    llama.cpp's K mixes do)."""
    if not isinstance(w, Packed):
        raise ValueError(f"{name} must be repacked weights (kernels.gemv.repack), got {type(w).__name__}")
    gemv._check_packed(w, w.qtype, n, k)


# The most query heads a threadgroup of a block's attention phase takes: its sums (G x D / 32 a
# lane) set the registers of the whole launch, every GEMV phase included. Qwen2.5-7B's 7 heads in
# one threadgroup took token_block to 166 registers (3 threadgroups an SM against 4) and its
# decode at depth 4096 from 328.7 to 257.8 tok/s; Llama-3-8B's 4 split further lost (332 -> 309).
BLOCK_HEADS = 4


def heads_split(group: int) -> int:
    """The fewest threadgroups (a divisor of the group) that share a kv head's `group` query heads
    in a block's attention phase so that each takes at most BLOCK_HEADS of them."""
    return min(qs for qs in range(1, group + 1) if group % qs == 0 and group // qs <= BLOCK_HEADS)


@dataclass(frozen=True)
class BlockGeometry:
    """A block launch's geometry: one threadgroup size (NSIMD SIMD groups) and one X' staging
    size (XCHUNK values, for the longest K) for every phase, and each GEMV kind's own rows a SIMD
    group, loads in flight and tickets (its threadgroups; the last phase's run unclaimed)."""

    simds: int
    xchunk: int
    gemvs: dict[int, tuple[int, int, int]]  # kind -> (R, P, tickets)


# A K-quant launch's GEMV phases issue at most this many 16-byte loads a row before using any (v3's
# P, 4 on their own): at 4 the 8B Q4_K_M token takes 156 registers (3 threadgroups an SM), at 2 it
# takes 125 (4), and megafused decodes 334-335 tok/s against 287 (H200, 936068b; kernels/loop/NOTES.md).
# gemv_tuning's BLOCK_P, when given, sets every launch's instead.
K_BLOCK_P = 2


def block_geometry(qtype: str, m: int, gemvs: dict[int, tuple[int, int]], last: int,
                   fit: int | None = None, reserved: int = 0, simds: int = 0) -> BlockGeometry:
    """The geometry of a launch of the GEMVs `gemvs` (kind -> its matrix's N, K; UP's N is 2F,
    [gate; up]; V, where V's rows are a matrix apart from [q; k], a part of the QKV phase) whose
    last phase is of kind `last`. `qtype`: the launch's block type (its first GEMV's), whose
    table sets every GEMV's knobs, whatever their own types: a kind's tickets are then one for
    every layer of a launch (the tickets of a phase are counted once a layer kind).

    block_geometry=shared (the option's default): every GEMV the first one's (UP's where the
    launch has one, else QKV's) R, NSIMD and P (R even with UP: its SwiGLU epilogue), each its
    own grid cap. per_gemv: NSIMD is TUNING's BLOCK_NSIMD, or the most any of the GEMVs takes
    on its own (v3_geometry); each GEMV then takes its own v3 R and P at that NSIMD (R halved
    where its rows would give fewer than MIN_GROUPS threadgroups) and its cap kept in SIMD groups
    (528 threadgroups of 4 are 264 of 8). Measured slower end to end (kernels/loop/NOTES.md): a
    launch runs at the registers of its hungriest phase (the 8B's QKV at R = 4), and fewer
    threadgroups fit on an SM for every phase.

    fit: threadgroups of the launch that the GPU holds at once (kernels.runtime.resident_groups),
    given where block_grid=resident: each claimed GEMV phase then takes at most that many tickets,
    so that it runs in one pass over resident threadgroups instead of a full pass and a partial
    one (a cap made for a standalone GEMV's lighter registers: kernels/loop/NOTES.md).

    reserved: threadgroup bytes the launch's other arrays take (attention's, the stream row):
    X' is then staged in chunks of 2048 values where all of the longest K would not fit beside
    them (Qwen2.5-7B's down, K = 18944, beside attention's arrays). block_xchunk caps the chunk.

    simds (batch_simds: the batch form's wide tickets): NSIMD, and each GEMV's R its shape's
    (v3_by_shape, or gemv_tuning's V3_R), neither halved to give the GPU MIN_GROUPS threadgroups."""
    order = [kind for kind in (UP, DOWN, QKV, O, V) if kind in gemvs]
    own = {kind: gemv.v3_geometry(qtype, m, *gemvs[kind], **(dict(
               rows=gemv.TUNING[qtype]["V3_R"] or gemv.v3_by_shape(*gemvs[kind], qtype)["R"], simds=simds)
               if simds else {})) for kind in order}
    longest = max(k for _, k in gemvs.values())
    shared = options.get("block_geometry") == "shared"
    if shared:
        r, s, p, _ = own[order[0]]
        per_kind = {kind: (r + (r % 2 if UP in gemvs else 0), p) for kind in order}
    else:
        s = simds or gemv.TUNING["BLOCK_NSIMD"] or max(g[1] for g in own.values())
        per_kind = {}
        for kind in order:
            r, _, p, _ = gemv.v3_geometry(qtype, m, *gemvs[kind], simds=s)
            per_kind[kind] = (r + r % 2 if kind == UP else r, p)
    _, _, _, xchunk = gemv.v3_geometry(qtype, m, 1, longest, 1, s, 1,
                                       budget=backends.threadgroup_memory() - reserved - 8)  # 8: ticket, flag
    most = options.get("block_xchunk")
    if most % 2048:  # (the chunks v3_geometry itself makes where K does not fit)
        raise ValueError(f"block_xchunk must be a multiple of 2048 values of X (0: all of K), got {most}")
    xchunk = min(xchunk, most or xchunk)
    out = {}
    for kind in order:
        n, k = gemvs[kind]
        r, p = per_kind[kind]
        p = min(p, gemv.TUNING["BLOCK_P"] or (K_BLOCK_P if qtype in gemv.K_QTYPES else p))
        tickets = -(-n // (r * s))
        cap = gemv.TUNING["V3_MAX_GROUPS"]
        if not cap:
            shaped = gemv.v3_by_shape(n, k, qtype)
            cap = shaped["G"] if shared else shaped["G"] * own[kind][1] // s
        if fit:
            cap = min(cap or fit, fit)
        # a capped grid streams row groups, which needs all of K staged at once; the last phase's
        # threadgroups are not claimed: as many as its groups run it at once
        if cap and xchunk >= k and kind != last:
            tickets = min(tickets, cap)
        out[kind] = (r, p, tickets)
    return BlockGeometry(s, xchunk, out)


def _by_hand(geo: BlockGeometry, gemvs: dict[int, tuple[int, int]], setting: str) -> BlockGeometry:
    """block_phases: each named GEMV phase's rows a SIMD group (r), loads in flight (p) and most
    tickets (t), as `setting` gives them ("down_r=4+down_t=256"). A phase's tickets are its row
    groups, or the most it had where the geometry capped them (a capped phase streams its row
    groups, each SIMD group taking several: its staged X' serves them all), or t. A cap needs all
    of K staged at once (the launch's last phase, whose groups are not claimed, runs on its first
    t threadgroups)."""
    names = {name.lower(): kind for kind, name in _KIND_NAMES.items()}
    out = dict(geo.gemvs)
    for pair in setting.split("+") if setting else []:
        key, _, value = pair.partition("=")
        name, _, knob = key.strip().lower().rpartition("_")
        if name not in names or knob not in ("r", "p", "t") or int(value) < 1:
            raise ValueError(f"block_phases takes KIND_r, KIND_p or KIND_t = a positive count (KIND one of "
                             f"{', '.join(names)}), got {pair!r}")
        if knob in ("r", "p") and int(value) > 16:  # (a SIMD group's registers hold RR x PR 16-byte words)
            raise ValueError(f"block_phases: {key.strip()} is at most 16, got {value}")
        kind = names[name]
        if kind not in out:
            continue  # (a launch without that phase)
        r, p, tickets = out[kind]
        n, k = gemvs[kind]
        groups = lambda rows: -(-n // (rows * geo.simds))  # noqa: E731 - tickets that cover N at `rows` a SIMD group
        if knob == "r":
            if kind == UP and int(value) % 2:
                raise ValueError(f"block_phases: up_r must be even (SwiGLU pairs rows), got {value}")
            capped = tickets < groups(r)
            r = int(value)
            tickets = min(groups(r), tickets) if capped else groups(r)
        elif knob == "p":
            p = int(value)
        else:
            if geo.xchunk < k:
                raise ValueError(f"block_phases: {name}_t needs all of its K ({k}) in one X' chunk "
                                 f"({geo.xchunk} values)")
            tickets = min(int(value), groups(r))
        out[kind] = (r, p, tickets)
    return BlockGeometry(geo.simds, geo.xchunk, out)


def _narrowed(geo: BlockGeometry, gemvs: dict[int, tuple[int, int]], below: int) -> BlockGeometry:
    """block_narrow: each GEMV phase but gate|up (whose SwiGLU pairs rows) with fewer than `below`
    tickets halves its rows a SIMD group until it has that many or takes one: a small phase
    (Qwen3-0.6B's O and down, 64 tickets of 16 rows) lasts one ticket's latency, while the launch's
    other threadgroups idle through it. Its tickets are then its row groups (not capped)."""
    out = dict(geo.gemvs)
    for kind, (r, p, tickets) in geo.gemvs.items():
        if kind == UP:
            continue
        while r > 1 and tickets < below:
            r //= 2
            tickets = -(-gemvs[kind][0] // (r * geo.simds))
        out[kind] = (r, p, tickets)
    return BlockGeometry(geo.simds, geo.xchunk, out)


def _balanced(geo: BlockGeometry, gemvs: dict[int, tuple[int, int]]) -> BlockGeometry:
    """block_balance: a GEMV phase (not gate|up) whose tickets are capped streams its row groups,
    SIMD group g taking g, g + stride, ... (stride: its tickets x NSIMD), so the phase lasts as
    long as the SIMD groups with the most rows. Its rows a SIMD group are halved while that
    lowers the most rows any SIMD group takes: Llama-3-8B's QKV (6144 rows over 528 tickets of 4)
    takes 4 rows in some SIMD groups and 2 in others at R = 2, at most 3 at R = 1 (its 3.2 us
    tail, kernels/loop/NOTES.md). Tickets stay as they are (the cap is the resident fit)."""
    out = dict(geo.gemvs)
    for kind, (r, p, tickets) in geo.gemvs.items():
        n = gemvs[kind][0]
        if kind == UP or tickets * r * geo.simds >= n:  # gate|up pairs rows; uncapped: a row group each
            continue
        stride = tickets * geo.simds

        def most(rows: int) -> int:  # the most rows a SIMD group takes at `rows` a row group
            groups = -(-n // rows)
            return rows * -(-groups // stride)

        while r > 1 and most(r // 2) < most(r):
            r //= 2
        out[kind] = (r, p, tickets)
    return BlockGeometry(geo.simds, geo.xchunk, out)


# block_two_passes: a single token's GEMV phase whose lanes take 4 or more passes over a row at
# the launch's P, where 7 loads in flight or fewer make it two, issues that many. The 8B's down
# runs as one wave of 512 tickets, so it lasts one ticket's latency, a DRAM round trip a pass:
# Q4_0's 14 loads a lane in 2 passes (P 7) against 4 took the plain module 1600 -> 1566 us a token
# (H200, eeee0d5; P 8 lost, 1670). Fewer passes saved lost (Llama-2-7B's down 3 -> 2 passes 1551 ->
# 1570 us, Qwen3's level), and so did 7 -> 4 (the Q8_0 8B's 28 loads, 2201 -> 2210 us): the rule
# keeps to the measured win. Split contexts' modules spill at 7 (NVRTC: 212 bytes) and the K-quants
# keep K_BLOCK_P for their registers (kernels/loop/NOTES.md).
TWO_PASSES_MOST_P = 7


def _two_passes(geo: BlockGeometry, gemvs: dict[int, tuple[int, int]], qtype: str) -> BlockGeometry:
    """Each GEMV phase whose lanes take 4 or more passes over a row (a lane's 16-byte loads of the
    row's staged chunk over P) at the P that makes them two, where that is at most TWO_PASSES_MOST_P."""
    out = dict(geo.gemvs)
    for kind, (r, p, tickets) in geo.gemvs.items():
        per_lane = gemv.lane_loads(qtype, min(geo.xchunk, gemvs[kind][1]))
        two = -(-per_lane // 2)
        if -(-per_lane // p) >= 4 and two <= TWO_PASSES_MOST_P:
            out[kind] = (r, two, tickets)
    return BlockGeometry(geo.simds, geo.xchunk, out)


class _FFN:
    """The FFN half's arguments, checked (one layer's; token_block's stacks replace the arrays)."""

    def __init__(self, x, ffn_norm, eps, w_gate_up, w_down, wide=False, max_m=gemv.MAX_M):
        if not isinstance(w_gate_up, Packed):
            raise ValueError(f"w_gate_up must be repacked weights (kernels.gemv.repack), got {type(w_gate_up).__name__}")
        d_model, n_up = x.shape[-1], w_gate_up.n
        _packed("w_gate_up", w_gate_up, n_up, d_model)
        gemv.check_gemv_args(x, w_gate_up, w_gate_up.qtype, n_up, d_model, max_m=max_m, wide_x=wide)
        if n_up % 2:
            raise ValueError(f"w_gate_up must be [gate; up], an even number of rows, got {n_up}")
        _packed("w_down", w_down, d_model, n_up // 2)
        gemv._check_norm(ffn_norm, eps, d_model)
        self.norm, self.w_gate_up, self.w_down, self.d, self.f = ffn_norm, w_gate_up, w_down, d_model, n_up // 2
        self.up_data, self.down_data = w_gate_up.data, w_down.data
        self.types = {UP: (w_gate_up.qtype,), DOWN: (w_down.qtype,)}  # each GEMV's, a layer of the launch each


class _Attention:
    """The attention half's arguments, checked (one layer's; token_block's stacks replace the
    arrays and give every layer's caches)."""

    def __init__(self, x, attn_norm, eps, w_qkv, w_o, k_cache, v_cache, pos, n_heads, theta, neox, q_norm,
                 k_norm, counters, split_from, w_v=None, wide=False, table=None, prompt=False):
        batch, block_size = x.shape[0], 0
        if table is None:  # one token (or `prompt`: x's rows one sequence's tokens), a contiguous cache
            attention._fp16("k_cache", k_cache)
            attention._fp16("v_cache", v_cache)
            if k_cache.ndim != 3 or tuple(v_cache.shape) != tuple(k_cache.shape):
                raise ValueError(f"k_cache and v_cache must both be [Hkv, max_seq, D], got "
                                 f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
            n_kv, max_seq, head_dim = k_cache.shape
        else:  # a token of each of `batch` sequences over the paged pool, their positions on the device
            _, n_kv, head_dim, block_size = paged.pool_shape(k_cache, v_cache)
            if not isinstance(table, mx.array) or table.dtype != mx.int32 or table.ndim != 2 \
                    or table.shape[0] != batch:
                raise ValueError(f"table must be int32 [{batch}, max_blocks] (a row a token of x), got "
                                 f"{getattr(table, 'dtype', type(table))} {getattr(table, 'shape', '')}")
            if not isinstance(pos, mx.array) or pos.dtype != mx.int32 or tuple(pos.shape) != (batch,):
                raise ValueError(f"with a table, pos must be int32 [{batch}] on the device (a position a "
                                 f"sequence), got {getattr(pos, 'dtype', type(pos))} {getattr(pos, 'shape', '')}")
            max_seq = table.shape[1] * block_size
        if head_dim not in attention.HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {attention.HEAD_DIMS}, got {head_dim}")
        if n_heads < n_kv or n_heads % n_kv:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of the cache's {n_kv} kv heads")
        d_model = x.shape[-1]
        n_qkv = (n_heads + 2 * n_kv) * head_dim
        n_qk = n_qkv if w_v is None else (n_heads + n_kv) * head_dim  # w_v: V's rows apart
        _packed("w_qkv" if w_v is None else "w_qkv ([q; k], w_v apart)", w_qkv, n_qk, d_model)
        gemv.check_gemv_args(x, w_qkv, w_qkv.qtype, n_qk, d_model,
                             max_m=1 if table is None and not prompt else BATCH_ROWS, wide_x=wide)
        if w_v is not None:
            _packed("w_v", w_v, n_kv * head_dim, d_model)
        _packed("w_o", w_o, d_model, n_heads * head_dim)
        gemv._check_norm(attn_norm, eps, d_model)
        head_norm = q_norm is not None or k_norm is not None
        self.norms = attention._head_norms(q_norm, k_norm, eps if head_norm else None, head_dim)
        if prompt:  # the rows' positions pos, pos + 1, ..: a prompt's, known on the host
            if not isinstance(pos, int) or pos < 0 or pos + batch > max_seq:
                raise ValueError(f"a prompt's {batch} rows take an int pos with pos + {batch} <= {max_seq} (the "
                                 f"cache), got {pos!r}")
            self.pos = constant(tuple(range(pos, pos + batch)))
        else:
            self.pos = rope._pos_array(pos, 1, max_seq) if table is None else pos
        self.__dict__.update(table=table, block_size=block_size, batch=batch, norm=attn_norm, w_qkv=w_qkv, w_o=w_o,
                             k_caches=[k_cache], v_caches=[v_cache], n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, theta=theta, neox=neox, counters=counters,
                             d=d_model, n_qkv=n_qkv, q_norm=q_norm, k_norm=k_norm, split_from=split_from,
                             longest=pos + batch if isinstance(pos, int) else max_seq, max_seq=max_seq, raw_pos=pos,
                             prompt=prompt,
                             rows=max_seq if table is None else table.shape[1],  # the kernel's dims[1]
                             qkv_data=w_qkv.data, o_data=w_o.data, w_v=w_v, n_qk=n_qk,
                             v_data=None if w_v is None else w_v.data,
                             # token_block's, where its layers say (LayerKind): a table a layer, a
                             # scale from the file, each layer's window
                             inv_freqs=None, scale=head_dim ** -0.5, windows=None,
                             stacked=False)  # token_block's: every layer's cache in one array
        self.types = {QKV: (w_qkv.qtype,), O: (w_o.qtype,), **({V: (w_v.qtype,)} if w_v is not None else {})}


@dataclass(frozen=True)
class _Dims:
    """Where a GEMV's dims input goes ([N, K, tickets]): filled once the tickets are known."""

    kind: int
    n: int
    k: int


_GRID = object()  # where the launch's (threadgroups, attention tickets) input goes


# Stamps a ticket of a timeline: claimed, its wait over, its outputs written; then, with option
# block_timeline_marks, inside an attention ticket its query ready (head norm, RoPE, the new K/V
# row), its first chunk's scores and its last chunk's P.V (decode_rows.metal's LATHE_MARK), all
# before the third; the other tickets leave those three unwritten (BlockTimeline.array fills
# them). In time: 0, 1, 3, 4, 5, 2. The marks are on the attention phase's path: they cost
# Qwen3-0.6B's stamped token about 7% at depth 0 on an H200 (kernels/loop/NOTES.md).
TIMELINE_STAMPS = 6


@dataclass(frozen=True)
class BlockTimeline:
    """A block launch's own record of its tickets (`timeline=` of token_block): `stamps` uint32
    [tickets, 3 or TIMELINE_STAMPS, 3], a row a ticket in claim order, then the last phase's
    groups; each row's stamps (claimed, its wait for the phase before over, its outputs written;
    with block_timeline_marks an attention ticket's three marks inside: TIMELINE_STAMPS above)
    each hold %globaltimer's low 32 bits (ns), the SM's %clock (cycles) and the SM
    (timeline_stamp in cuda_compat.h). `kinds` and `tickets`: each phase's kind (QKV .. DOWN)
    and ticket count, in phase order. `groups`: the launch's threadgroups, whose rows follow the
    tickets' (group_stamps). harness.tools.block_timeline reads it."""

    stamps: mx.array
    kinds: tuple[int, ...]
    tickets: tuple[int, ...]
    groups: int = 0

    def array(self) -> np.ndarray:
        """The stamps as numpy [tickets, 3 or TIMELINE_STAMPS, 3], every row whole: with the
        marks inside (block_timeline_marks), the tickets of the phases but the attention's leave
        them unwritten (a stamp costs), so theirs take the third stamp's value, the one that
        follows them in time (intervals of zero)."""
        stamps = np.array(self.stamps)[:sum(self.tickets)]
        if stamps.shape[1] <= 3:
            return stamps
        edges = np.cumsum((0,) + tuple(self.tickets))
        for kind, begin, end in zip(self.kinds, edges[:-1], edges[1:]):
            if kind != ATTN:
                stamps[begin:end, 3:] = stamps[begin:end, 2:3]
        return stamps

    def group_stamps(self) -> np.ndarray:
        """Each threadgroup's own stamps [groups, 3, 3], in the tickets' words: its start, the end
        of its claims (out of its loop) and its exit (after the queue's resets, for the last one out)."""
        return np.array(self.stamps)[sum(self.tickets):sum(self.tickets) + self.groups, :3]


# block_min_groups auto: the token block held to 4 threadgroups of 4 SIMD groups an SM (128
# registers) where measured: Llama-3-8B's went from 3 an SM to 4 on an H200 (the device's NVRTC:
# 131 registers at 4096 tokens, 128 with no more local memory), +2.3% at depth 0, +9.5% at 4096,
# +12.5% for Q8_0. Not the attention's MMA form (K's slot and the scores on SIMD-group matrices:
# 167 registers in Qwen3-0.6B's split module, which spilled under the bound and lost 8% at 4096;
# Llama-2-7B's and Llama-3.2-1B's split modules take the form too), nor head norms (Qwen3's,
# level at depth 0) or post norms (Gemma's heads of 256), nor the paged batch form (unmeasured
# under it; on fixed inputs its checks give the same error with the bound as without, so the
# tolerance misses once seen under it were the spread of fresh inputs). kernels/loop/NOTES.md.
MIN_GROUPS_AUTO = 4
# block_batch_simds auto: the batch form's tickets of 8 SIMD groups past this many sequences. Each
# ticket quantizes all M rows of its phase's X' (8 x 3072 values for Qwen3's down), the same for every
# ticket: at 8 SIMD groups (each ticket twice the rows) Qwen3-0.6B's step of 8 took 12-15% less GPU
# time on an H200, level at 4 sequences, 10-20% more at 2 (kernels/loop/NOTES.md). Held to 2
# threadgroups an SM (128 registers): the compiler's 130 left one, and no gain. Not where the context
# may split (past block_split_from): that module spills under the bound (NVRTC: 168 bytes), unmeasured.
BATCH_SIMDS_FROM = 5
BATCH_SIMDS_AUTO = 8


def batch_simds(attn: "_Attention | None") -> int:
    """NSIMD of a block launch's wide tickets (block_batch_simds; 0: the shared geometry's), for
    token_block's batch form (a token of each of M > 1 sequences over the paged pool), and for a
    single token's launch where the option is set (auto leaves it the shared geometry's)."""
    if attn is None:
        return 0
    wide = options.get("block_batch_simds")
    if wide is not None and wide not in (0, 4, 8):
        # (16 was tried: the step took 0.2-1.6 s, not 1.3 ms; not understood, so not offered)
        raise ValueError(f"block_batch_simds must be 0, 4 or 8 SIMD groups a threadgroup, got {wide}")
    if attn.table is None or attn.batch < 2:
        return wide if wide and attn.table is None and attn.batch == 1 and not attn.prompt else 0
    if wide is None:
        return BATCH_SIMDS_AUTO if attn.batch >= BATCH_SIMDS_FROM and attn.longest <= attn.split_from else 0
    return wide


def min_groups(first: int, phases: int, simds: int, attn: "_Attention | None", kind: LayerKind,
               mma: bool = False) -> int:
    """The threadgroups an SM a launch is compiled for (launch bounds; 0: the compiler's choice):
    the block_min_groups option, or its auto rule (above); `mma`: the attention phase takes the
    MMA form (its MMA constant)."""
    least = options.get("block_min_groups")
    if least is not None:
        return least
    if batch_simds(attn):  # the batch form's wide tickets: held to 128 registers a thread
        return 65536 // (128 * 32 * simds)
    token = (first, phases) not in ((QKV, 3), (UP, 2), (UP, 5))  # token_block, not the named halves
    plain = (attn is not None and not attn.norms and attn.table is None and attn.batch == 1 and not kind.post_norms
             and attn.head_dim <= 128 and not mma)
    return MIN_GROUPS_AUTO if token and plain and simds == 4 else 0


def attention_grid(least: int) -> int:
    """Threadgroups the attention phase's partitions aim at: the attn_split_grid option; else,
    where the launch is bound to `least` threadgroups an SM (min_groups) on a GPU whose SMs are
    known, every one it holds, so that the phase's tickets fill one wave (the 8B at 16384 tokens:
    65 partitions of 2 chunks a kv head, 520 tickets for 528 threadgroups, where SPLIT_GRID's 512
    made 44 of 3 chunks and left a third of them idle); else attention's SPLIT_GRID. (The split
    grid of the register form: the blocks keep K in registers unless block_k_slots says otherwise.)"""
    return options.get("attn_split_grid") or resident_threadgroups(least) or attention.split_grid(0)


def resident_threadgroups(least: int) -> int | None:
    """The threadgroups a launch bound to `least` an SM holds at once on this GPU: None where it
    is not bound or the SMs are not known (off CUDA, while recording)."""
    sms = runtime.sm_count() if least else None
    return least * sms if sms else None


def attention_query_split(group: int, n_kv: int, parts: int, least: int) -> int:
    """Threadgroups that share a kv head's `group` query heads in the attention phase of `parts`
    partitions (attention.query_split): under the attn_query_split option where it is set; else,
    in a launch bound to `least` threadgroups an SM on a GPU whose SMs are known, the most for
    which the tickets of every partition but the last fit the threadgroups it holds, so that the
    phase fills one wave. The last partition is left out because it holds the cache's unfilled
    rows for most of its life (the grid is sized for the longest context a call can see), so its
    tickets mostly end at once. The 8B at 4096 + 144 rows: 34 partitions of a chunk, 272 tickets
    of 4 query heads for 528 threadgroups; as 544 of 2 its token took 1.384-1.395x llama.cpp
    against 1.364-1.370x (kernels/loop/NOTES.md). Elsewhere, attention's bound."""
    most = options.get("attn_query_split")
    held = resident_threadgroups(least) if most is None else None
    if held:
        return attention.query_split(group, n_kv * max(parts - 1, 1), held)
    return attention.query_split(group, n_kv * parts, most)


def _launch(x: mx.array, eps: float, qtype: str, first: int, phases: int, ffn: _FFN | None, attn: _Attention | None,
            queue: mx.array | None, strides: dict[str, int] | None = None, layer_kind: LayerKind = LLAMA,
            post_norms: tuple[mx.array, mx.array] | None = None, qkv_bias: mx.array | None = None,
            timeline: list | None = None, share: int = 1, after: mx.array | None = None) -> list[mx.array]:
    """layer_block.metal over `phases` phases from kind `first` (the halves given hold each
    kind's arrays; `strides`: bytes between layers of each stacked input, token_block's;
    `layer_kind` and `post_norms` (post_attention_norm, post_ffw_norm stacked): token_block's
    layers): its outputs in the spec's order. `timeline`: a list that gets the launch's
    BlockTimeline (its tickets stamped; CUDA only). `share`: launches meant to run at once, each
    sized to 1 / share of the threadgroups the GPU holds (block_grid=resident). `after`: the prompt
    form's, an output of the launch this one follows."""
    queue = block_queue(phases) if queue is None else queue
    _check_queue(queue, phases)
    m = x.shape[0]
    last = (first + phases - 1) % 5
    gemvs = {}
    if ffn:
        gemvs.update({UP: (2 * ffn.f, ffn.d), DOWN: (ffn.d, ffn.f)})
    if attn:
        gemvs.update({QKV: (attn.n_qk, attn.d), O: (attn.d, attn.n_heads * attn.head_dim)})
        if attn.w_v is not None:
            gemvs[V] = (attn.n_kv * attn.head_dim, attn.d)
    def attention_layout(s: int) -> tuple[int, bool, int, int]:
        """(partition, split, parts, query split) of the attention phase at NSIMD s: its
        partitions as flash_decode would split them (the grid sized for the longest context a
        call can see, below), merged in the launch, at most MERGE_PARTS of them."""
        a, chunk = attn, s * 32  # decode_rows' tokens a chunk at this NSIMD
        least = min_groups(first, phases, s, attn, layer_kind)
        # the grid counts every query's kv heads: the batch form's 8 sequences at 1040 tokens took
        # 576 tickets of one chunk (1.5 waves of 384 threadgroups) where n_kv alone was counted
        partition = options.get("attn_partition") or attention.auto_partition(a.longest, a.n_kv * a.batch,
                                                                              attention_grid(least))
        partition = max(-(-partition // chunk) * chunk, -(-a.longest // (attention.MERGE_PARTS * chunk)) * chunk)
        split = a.longest > partition and a.longest > a.split_from
        parts = -(-a.longest // partition) if split else 1
        group = a.n_heads // a.n_kv
        return partition, split, parts, max(attention_query_split(group, a.n_kv, parts, least), heads_split(group))

    rms_late = bool(options.get("block_rms_late"))  # (kernels/loop/NOTES.md: "The RMSNorm from the staging's own loads")

    def reserved(s: int) -> int:
        """Threadgroup bytes beside the GEMVs' staging: the stream row (post-norms), block_rms_late's
        scratch past v3's own, and the attention's arrays with no K slots (the slots take what is
        left: below)."""
        post = (4 * x.shape[-1] if layer_kind.post_norms else 0) + (
            gemv.v3_smem_bytes(m, 0, s, True) - gemv.v3_smem_bytes(m, 0, s) if rms_late else 0)
        if not attn:
            return post
        _, split, parts, qs = attention_layout(s)
        return post + attention.decode_threadgroup_bytes((attn.n_heads // attn.n_kv) // qs, attn.head_dim, s,
                                                         bool(attn.norms), parts if split else 0)

    narrow, balance = options.get("block_narrow"), options.get("block_balance")

    def geometry(fit: int | None = None) -> BlockGeometry:
        g = block_geometry(qtype, m, gemvs, last, fit, held, batch_simds(attn))
        g = _narrowed(g, gemvs, narrow) if narrow else g
        g = _balanced(g, gemvs) if balance else g
        if (m == 1 and options.get("block_two_passes") and qtype not in gemv.K_QTYPES
                and not (attn and attention_layout(g.simds)[1])):
            g = _two_passes(g, gemvs, qtype)
        return _by_hand(g, gemvs, options.get("block_phases"))

    held = 0
    geo = geometry()
    if _gemv_bytes(m, geo.xchunk, geo.simds) + reserved(geo.simds) > backends.threadgroup_memory():
        held = reserved(geo.simds)  # (NSIMD does not depend on the budget: geo.simds stays)
        geo = geometry()
    s = geo.simds
    strides = {"W_QKV_STRIDE": 0, "W_O_STRIDE": 0, "W_UP_STRIDE": 0, "W_DOWN_STRIDE": 0, "NORM_STRIDE": 0,
               "HEAD_NORM_STRIDE": 0, **({"W_V_STRIDE": 0} if V in gemvs else {}), **(strides or {})}
    inputs, consts = [], dict(QTYPE=gemv.block_format(qtype)[0], M=m, NSIMD=s, XCHUNK=geo.xchunk, FIRST=first,
                              PHASES=phases, PREFETCH=_prefetch_kinds(),
                              SIGNAL_APART=bool(options.get("block_signal_apart")), RMS_LATE=rms_late,
                              L2_AHEAD=bool(options.get("block_l2_ahead")),
                              XITEMS=gemv.x_stage_items("block_x_items", m),
                              ROW_PASSES=gemv.row_passes(), **strides)
    if attn:  # the attention phase's cached rows into the L2 before its wait (a decode token's)
        consts["ATTN_AHEAD"] = bool(options.get("block_attn_ahead")) and not attn.prompt
    for kind in geo.gemvs:
        consts.update({f"R_{_KIND_NAMES[kind]}": geo.gemvs[kind][0], f"P_{_KIND_NAMES[kind]}": geo.gemvs[kind][1]})
    types, layer_types = _launch_types({**(ffn.types if ffn else {}), **(attn.types if attn else {})},
                                       (first + phases - 1) // 5 + 1, first)
    outputs: list = []
    attn_tickets, split = 0, False
    stream = mx.float32 if layer_kind.post_norms else mx.float16  # the residual stream's type
    if ffn:
        inputs += [ffn.norm, ffn.up_data, _Dims(UP, 2 * ffn.f, ffn.d), ffn.down_data, _Dims(DOWN, ffn.d, ffn.f)]
        outputs += [((m, ffn.f), mx.float16), ((m, ffn.d), stream)]
        consts.update(K_UP=ffn.d, K_DOWN=ffn.f)
    if attn:
        a = attn
        group, chunk = a.n_heads // a.n_kv, s * 32
        partition, split, parts, qs = attention_layout(s)
        attn_tickets = parts * a.n_kv * qs * a.batch
        inputs += [a.norm, a.qkv_data, _Dims(QKV, a.n_qk, a.d)]
        if a.w_v is not None:
            inputs += [a.v_data, _Dims(V, a.n_kv * a.head_dim, a.d)]
        inputs += [*a.k_caches, *a.v_caches, a.pos, *([a.table] if a.table is not None else []),
                   rope._table(a.head_dim, a.theta, None) if a.inv_freqs is None else a.inv_freqs,
                   constant((float(a.theta), 1.0, float(eps)), mx.float32),
                   # dims[4]: 0 where every query reads one cache (a prompt's rows), else its own
                   constant((a.n_kv, a.rows, partition, parts, int(not a.prompt))),
                   constant((float(a.scale),), mx.float32),
                   *a.norms]
        if split:
            counters = attention.merge_counters(a.n_kv * qs * a.batch) if a.counters is None else a.counters
            attention._check_counters(counters, a.n_kv * qs * a.batch)
            inputs.append(counters)
        inputs += [a.o_data, _Dims(O, a.d, a.n_heads * a.head_dim)]
        b = a.batch
        outputs += [((b, a.n_qkv), mx.float16), ((b, a.n_heads, a.head_dim), mx.float16), ((b, a.d), stream)]
        if split:
            outputs += [((b, a.n_heads, parts, a.head_dim), mx.float32), ((b, a.n_heads, parts, 2), mx.float32)]
        slots, early = options.get("block_k_slots"), options.get("block_k_early")
        auto_unsplit = slots is None and not split
        # the bytes the attention's arrays and K's slots may take beside the GEMV phases' staging
        budget = (backends.threadgroup_memory() - _gemv_bytes(m, geo.xchunk, s, rms_late)
                  - (4 * a.d if layer_kind.post_norms else 0))
        merged = parts if split else 0  # (the partitions whose weights the merge holds)
        # auto (block_k_early and block_k_slots both): a decode token's attention with head norms and
        # heads of up to 128 values (Qwen3's layer: two slots hold a whole K row) copies both rounds
        # of K early through two slots without the MMA form, split or not, where two slots fit:
        # Qwen3-0.6B's token 1.7-3% faster at depth 0 and at 4096 tokens on an H200, where one slot
        # early lost 4% at depth 0 (NOTES.md, "K's first rounds before the wait"). Elsewhere (Gemma's
        # heads of 256, unmeasured) the form of before
        two_early = (early is None and slots is None and bool(a.norms) and a.head_dim <= 128 and a.batch == 1
                     and not a.prompt and a.table is None
                     and attention.slots_that_fit(2, group // qs, a.head_dim, s, True, merged, False, budget) == 2)
        if slots is None:  # auto: 1, with the MMA form wherever the context is split. A second slot
            # took Qwen3-0.6B's split module to 185 registers (2 threadgroups an SM against 168 and 3)
            # once a lane's passes stopped at its row: 5-6% slower at 4096 tokens on an H200. Unsplit,
            # without the MMA form (its registers lost 3.8% there). NOTES.md has both.
            slots = 2 if two_early else 1
        if slots not in (0, 1, 2):
            raise ValueError(f"block_k_slots must be 0, 1 or 2, got {slots}")
        mma = (bool(options.get("block_attn_mma")) and not auto_unsplit and not two_early and slots > 0
               and attention.mma_form(group // qs, a.head_dim, s))
        # at most `slots`: fewer where the launch's threadgroup memory cannot hold them beside the
        # GEMV phases' (a slot is 4 KiB a SIMD group)
        want = slots
        slots = attention.slots_that_fit(want, group // qs, a.head_dim, s, bool(a.norms), merged, mma, budget)
        in_x = 0
        if slots < want and options.get("block_k_in_x"):
            # block_k_in_x: the slots in the staged X' (2 bytes a value, M rows), which an attention
            # ticket does not read, the attention's other arrays beside it (the 8B's token block:
            # its X' chunk of 14336 values leaves no room for a slot)
            held = min(want, 2 * m * geo.xchunk // attention.k_slot_bytes(a.head_dim, s))
            if held > slots and attention.decode_threadgroup_bytes(group // qs, a.head_dim, s, bool(a.norms),
                                                                   merged, 0, mma) <= budget:
                slots, in_x = held, 1
        mma = int(mma and slots > 0)
        consts.update(K_QKV=a.d, K_O=a.n_heads * a.head_dim, D=a.head_dim, G=group // qs, QS=qs, BS=a.block_size,
                      NEOX=a.neox, FREQ_TABLE=True, KSLOTS=slots, KIN_X=in_x, MMA=mma,
                      VSTRAIGHT=bool(options.get("block_v_straight")),
                      KEARLY=bool(early or two_early) and slots > 0,
                      ROPE_STRIDE=0 if a.inv_freqs is None or a.inv_freqs.ndim == 1 else a.head_dim // 2)
        if split:
            consts.update(attention.merge_constants(group // qs, a.head_dim, s, parts))
    inputs = [x, gemv._eps(float(eps)), _GRID, queue] + inputs
    if layer_types is not None:
        inputs.append(constant(layer_types, mx.uint32))
    if layer_kind.post_norms:
        inputs += list(post_norms)
        outputs.append(((1, x.shape[-1]), mx.float16))  # blk: a block's output before its post-norm
    if layer_kind.windows:
        inputs.append(constant(attn.windows))
    if layer_kind.qkv_bias:
        inputs.append(qkv_bias)
        consts["QKV_BIAS_STRIDE"] = qkv_bias.shape[1]
    # block_o_codes: M queries' attention writes the O phase's X' once (unsplit: the merge writes it
    # otherwise), where each O ticket quantized all M rows of attn_out (layer_block.metal's O_CODES)
    o_codes_set = options.get("block_o_codes")
    o_codes = bool(attn) and not split and (m > 1 if o_codes_set == "auto" else bool(o_codes_set))
    if o_codes:
        k_o = attn.n_heads * attn.head_dim
        outputs += [((m, k_o), mx.int16), ((m, k_o // 32), mx.float32), ((m, k_o // 32), mx.int32)]
    # block_act_codes: the UP phase quantizes act once for the DOWN phase (gemv/y_codes.metal), its
    # blocks counted in the queue (whole blocks of F: F / 32 counts at most); any M
    act_codes = (bool(ffn) and ffn.f % 32 == 0
                 and ffn.f // 32 <= BLOCK_COUNTS and bool(options.get("block_act_codes")))
    if act_codes:
        outputs += [((m, ffn.f), mx.int16), ((m, ffn.f // 32), mx.float32), ((m, ffn.f // 32), mx.int32)]
    prompt = bool(attn and attn.prompt)
    if prompt:
        inputs.append(attention._no_order() if after is None else after)
    caches = len(attn.k_caches) if attn else 1
    stacked = bool(attn and attn.stacked)
    # a ticket's stamps (none without a timeline): claimed, let go, done; and the attention's marks
    stamps = 0 if timeline is None else TIMELINE_STAMPS if options.get("block_timeline_marks") else 3
    least = min_groups(first, phases, s, attn, layer_kind, bool(consts.get("MMA")))
    spec = _spec(first, phases, caches, split, bool(attn and attn.norms), types, layer_kind,
                 bool(attn and attn.table is not None), stamps, stacked, (32 * s, least) if least else None, prompt,
                 o_codes, act_codes)
    kinds = tuple((first + j) % 5 for j in range(phases))

    def phase_tickets(geo: BlockGeometry) -> tuple[int, ...]:  # each phase's (layer_block.metal's kind_tickets)
        tickets = {kind: g[2] for kind, g in geo.gemvs.items()}
        of_kind = {QKV: tickets.get(QKV, 0) + tickets.get(V, 0), ATTN: attn_tickets, O: tickets.get(O, 0),
                   UP: tickets.get(UP, 0), DOWN: tickets.get(DOWN, 0)}
        return tuple(of_kind[kind] for kind in kinds)

    def at(geo: BlockGeometry) -> Launch:  # the launch with geo's tickets
        tickets = {kind: g[2] for kind, g in geo.gemvs.items()}
        launched = max(tickets.values())
        filled = [gemv._dims(i.n, i.k, tickets[i.kind]) if isinstance(i, _Dims)
                  else constant((launched, attn_tickets)) if i is _GRID else i for i in inputs]
        # a row a ticket, then a row a threadgroup (layer_block.metal's GROUP_STAMP)
        stamped = [((sum(phase_tickets(geo)) + launched, stamps, 3), mx.uint32)] if stamps else []
        return Launch(spec, filled, outputs + stamped, (launched * 32 * s, 1, 1), (32 * s, 1, 1), consts)

    job = at(geo)
    if options.get("block_grid") == "resident":
        # the tickets are inputs, not the module: its occupancy sizes them (cached per module)
        fit = resident_groups(job)
        if fit:
            fit = max(1, fit // share)
            geo = geometry(fit)
            job = at(geo)
    out = launch(job)
    if timeline is not None:
        timeline.append(BlockTimeline(out[-1], kinds, phase_tickets(geo), job.grid[0] // job.threadgroup[0]))
        out = out[:-1]
    scratch = 3 * (int(o_codes) + int(act_codes))  # the X' outputs
    return out[:-scratch] if scratch else out


def _prefetch_kinds() -> int:
    """layer_block.metal's PREFETCH: bit kind set where that GEMV phase issues its first weights
    before its wait (block_prefetch, less the kinds of block_prefetch_skip)."""
    if not options.get("block_prefetch"):
        return 0
    skip = set(filter(None, (options.get("block_prefetch_skip") or "").split("+")))
    return sum(1 << kind for name, kind in (("qkv", QKV), ("o", O), ("up", UP), ("down", DOWN)) if name not in skip)


def _launch_types(per_layer: dict[int, tuple[str, ...]], layers: int, first: int
                  ) -> tuple[tuple[tuple[int, int, int], ...], tuple[int, ...] | None]:
    """Each GEMV's block types in a launch of `layers` layers (from phase kind `first`), from
    each kind's matrix types (one, or one a layer: token_block's stacks): (kind, type A, type B)
    as format codes, A the type of most layers (the first layer's on a tie); and the launch's
    layer_types words (bit kind set: that layer's matrix of that kind is of type B), None where
    every kind has one type."""
    types, words = [], [0] * layers
    for kind in sorted(per_layer):
        seen = per_layer[kind]
        a = max(dict.fromkeys(seen), key=seen.count)
        b = next((t for t in seen if t != a), a)
        types.append((kind, gemv.block_format(a)[0], gemv.block_format(b)[0]))
        if b != a:
            if len(seen) != layers or first != QKV:
                raise ValueError("a block type a layer needs a launch of whole layers (token_block)")
            for layer, t in enumerate(seen):
                words[layer] |= int(t == b) << kind  # the kernel's bits: QKV 0, O 2, UP 3, DOWN 4, V_BIT 5
    mixed = any(a != b for _, a, b in types)
    return tuple(types), tuple(words) if mixed else None


def attention_block(x: mx.array, attn_norm: mx.array, eps: float, w_qkv: Packed, w_o: Packed, qtype: str,
                    k_cache: mx.array, v_cache: mx.array, pos: int | mx.array, *, n_heads: int,
                    theta: float = 10000.0, neox: bool = False, q_norm: mx.array | None = None,
                    k_norm: mx.array | None = None, queue: mx.array | None = None,
                    counters: mx.array | None = None, split_from: int = attention.SPLIT_FROM,
                    w_v: Packed | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One decode token's attention half of a layer: x [1, d_model] (the residual stream) ->
    (x + Attention(RoPE(RMSNorm(x) W_qkv^T)) W_o^T, k_cache, v_cache), K and V of the token
    written at row pos of the head-major caches [n_kv, max_seq, D] (in place; the returned
    caches are ordered after the write). q_norm, k_norm (f32[D]): Qwen3's head norms (eps is
    then theirs too). pos: an int (checked) or int32[1] on the device (a compiled step: the
    attention's grid is sized for max_seq). queue / counters: the launch site's (block_queue,
    attention.merge_counters); fresh ones when not given. w_v: V's rows as a matrix of their own
    (w_qkv is then [q; k]): where they have another block type (llama.cpp's Q4_K_M). `qtype` is
    w_qkv's; w_o and w_v may have other types."""
    attn = _Attention(x, attn_norm, eps, w_qkv, w_o, k_cache, v_cache, pos, n_heads, theta, neox, q_norm,
                      k_norm, counters, split_from, w_v)
    if not backends.cross_group_waits():
        return _attention_apart(x, eps, qtype, attn)
    x_out = _launch(x, eps, qtype, QKV, 3, None, attn, queue)[2]
    k_cache, v_cache = depends([k_cache, v_cache], [x_out])
    return x_out, k_cache, v_cache


def ffn_block(x: mx.array, ffn_norm: mx.array, eps: float, w_gate_up: Packed, w_down: Packed, qtype: str, *,
              queue: mx.array | None = None) -> mx.array:
    """The FFN half of a layer for M = 1..4 tokens: x [M, d_model] -> x + (silu(X' W_gate^T) *
    (X' W_up^T)) W_down^T, X' = RMSNorm(x) * ffn_norm, W_gate_up = [gate; up] (2F rows) repacked.
    queue: the launch site's (block_queue); a fresh one when not given."""
    ffn = _FFN(x, ffn_norm, eps, w_gate_up, w_down)
    if not backends.cross_group_waits():
        return _ffn_apart(x, eps, qtype, ffn)
    return _launch(x, eps, qtype, UP, 2, ffn, None, queue)[1]


def layer_block(x: mx.array, ffn_norm: mx.array, w_gate_up: Packed, w_down: Packed, attn_norm: mx.array,
                w_qkv: Packed, w_o: Packed, eps: float, qtype: str, k_cache: mx.array, v_cache: mx.array,
                pos: int | mx.array, *, n_heads: int, theta: float = 10000.0, neox: bool = False,
                q_norm: mx.array | None = None, k_norm: mx.array | None = None, queue: mx.array | None = None,
                counters: mx.array | None = None, split_from: int = attention.SPLIT_FROM,
                w_v: Packed | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """A layer's FFN block, then the next layer's attention block, in one launch for one decode
    token: ffn_block's arguments (ffn_norm, w_gate_up, w_down), then attention_block's over its
    output (the caches, head norms and w_v are the next layer's). Returns attention_block's.
    `qtype` is w_gate_up's; the other matrices may have other types."""
    ffn = _FFN(x, ffn_norm, eps, w_gate_up, w_down)
    attn = _Attention(x, attn_norm, eps, w_qkv, w_o, k_cache, v_cache, pos, n_heads, theta, neox, q_norm,
                      k_norm, counters, split_from, w_v)
    if x.shape[0] != 1:
        raise ValueError(f"layer_block takes one token (x [1, d_model]), got {tuple(x.shape)}")
    if not backends.cross_group_waits():
        return _attention_apart(_ffn_apart(x, eps, qtype, ffn), eps, qtype, attn)
    x_out = _launch(x, eps, qtype, UP, 5, ffn, attn, queue)[4]
    k_cache, v_cache = depends([k_cache, v_cache], [x_out])
    return x_out, k_cache, v_cache


@dataclass
class LayerStacks:
    """Every layer's weights of a decoder, stacked for token_block: the four projections as
    Stacks ([q; k; v] and [gate; up] concatenated), the RMSNorm weights as fp16 [layers, d_model]
    and Qwen3's head norms as float32 [layers, head_dim] (None for Llama). w_v: V's matrices
    apart, where some layer's differs in type from its Q and K (w_qkv then holds [q; k]).
    post_attn_norm, post_ffn_norm: Gemma's post-block norms, fp16 [layers, d_model]. qkv_bias:
    Qwen2's Q, K and V biases, fp16 [layers, n_q + n_k + n_v] (LayerKind.qkv_bias)."""

    attn_norm: mx.array
    w_qkv: Stack
    w_o: Stack
    ffn_norm: mx.array
    w_gate_up: Stack
    w_down: Stack
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None
    w_v: Stack | None = None
    post_attn_norm: mx.array | None = None
    post_ffn_norm: mx.array | None = None
    qkv_bias: mx.array | None = None

    @property
    def layers(self) -> int:
        return self.w_qkv.layers

    @property
    def values(self) -> int:
        """The weights a token's pass through every layer multiplies (one dot product term each):
        what token_block's batch form repeats for each more sequence it takes."""
        mats = (self.w_qkv, self.w_o, self.w_gate_up, self.w_down) + ((self.w_v,) if self.w_v else ())
        return sum(s.n * s.k * s.layers for s in mats)


def token_block(x: mx.array, weights: LayerStacks, eps: float, qtype: str, k_caches: list[mx.array] | mx.array,
                v_caches: list[mx.array] | mx.array, pos: int | mx.array, *, n_heads: int, theta: float = 10000.0,
                neox: bool = False, queue: mx.array | None = None, counters: mx.array | None = None,
                split_from: int | None = None, layer_kind: LayerKind = LLAMA,
                inv_freqs: mx.array | None = None, scale: float | None = None,
                windows: list[int] | None = None, table: mx.array | None = None, timeline: list | None = None,
                share: int = 1, after: mx.array | None = None
                ) -> tuple[mx.array, list[mx.array] | mx.array, list[mx.array] | mx.array]:
    """A decode token through every layer in one launch (the seeds' persistent kernel): each
    layer's attention block, then its FFN block, as phases of one queue (block_queue(5 * layers)).
    x [1, d_model] (the embedded token) -> (the residual stream after the last layer, k_caches,
    v_caches), K and V of layer l written at row pos of k_caches[l] / v_caches[l] in place (the
    returned caches are ordered after the writes). The other arguments are attention_block's.
    k_caches / v_caches: a list of each layer's [Hkv, max_seq, D], or every layer's in one array
    [layers, Hkv, max_seq, D] (returned as given): two inputs and outputs instead of 2 x layers,
    which a compiled decode step replays and MLX encodes at a cost of host time for each array.
    Gemma's layers (layer_kind): post_norms, x and the result float32, weights.post_attn_norm and
    post_ffn_norm given (the last post-norm is a second launch, loop.post_norm_add); windows
    (`windows`, one a layer, 0: none); a GELU gate; a softcap of the scores. Qwen2's layers:
    layer_kind.qkv_bias and weights.qkv_bias, added in the QKV phase. inv_freqs: a RoPE
    table float32 [D / 2], or one a layer [layers, D / 2] (else the base `theta`'s); scale: the
    attention's (default 1 / sqrt(D)).

    The batch form (`table` given): a decode token of each of M = 1..BATCH_ROWS sequences over
    the paged pool (continuous batching's decode step, harness.program.batch_forward): x [M,
    d_model], pos int32 [M] (each token's position) and table int32 [M, max_blocks] (each
    sequence's blocks) on the device, k_caches / v_caches each layer's pool (kernels.paged's
    layouts); each GEMV phase runs its M rows over one read of the weights, the attention phase
    a task a (partition, head group, sequence), K and V of token b written at its slot in its
    own blocks. The kernel clamps a position to its table's blocks; the caller checks the
    table's entries. Not with Gemma's post-block norms (one stream row).

    The prompt form (x [M, d_model], M = 2..BATCH_ROWS, no table): M tokens of one sequence at
    positions pos, pos + 1, .. (pos an int; pos + M within the caches), causal: each GEMV phase
    runs the M rows over one read of the weights, and the attention ticket of token b writes its
    K and V rows, then waits for those of tokens 0..b - 1 (layer_block.metal's PROMPT_ROWS). A
    short prompt in one launch rather than a few a layer (harness.program.kernel_decode's
    mega_prompt_rows). Not with Gemma's post-block norms; CUDA only (one launch). `after`: an
    output of the launch before (the prompt's rows before these): MLX orders launches by the
    arrays they take, and the caches that launch wrote in place are not its outputs, so without
    it the two may run at once (and share the queue).

    timeline: a list that gets the launch's BlockTimeline, each ticket stamped as it runs
    (harness.tools.block_timeline); CUDA only (%globaltimer), where the launch is one.

    share: how many token_block launches of the batch form the caller runs at once (a step's
    launches over disjoint sequences, none taking another's caches): each is sized to 1 / share
    of the threadgroups the GPU holds, so that all of them are resident together."""
    w, layers, post = weights, weights.layers, layer_kind.post_norms
    # past this many tokens the attention phase splits the context (block_split_from): unsplit, it
    # is one ticket a kv head (Qwen3-0.6B: 16 of 528 threadgroups) walking every chunk in turn, 42 us
    # a layer at 1024 tokens against 17 split at 4096; split from 512, the 1024-token layer takes 14
    # (kernels/loop/NOTES.md)
    split_from = options.get("block_split_from") if split_from is None else split_from
    if post and (w.post_attn_norm is None or w.post_ffn_norm is None):
        raise ValueError("post-block norms need the stacks' post_attn_norm and post_ffn_norm")
    if post and x.dtype != mx.float32:
        raise ValueError(f"post-block norms run over a float32 residual stream: x must be float32, got {x.dtype}")
    if layer_kind.activation not in loop.ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(loop.ACTIVATIONS)}, got {layer_kind.activation!r}")
    if layer_kind.windows and (windows is None or len(windows) != layers or any(int(v) < 0 for v in windows)):
        raise ValueError(f"windowed layers need a window >= 0 for each of the {layers} layers, got {windows}")
    if layer_kind.qkv_bias != (w.qkv_bias is not None):
        raise ValueError("Q/K/V biases need both the layer kind's qkv_bias and the stacks' qkv_bias")
    stacked = isinstance(k_caches, mx.array)
    if stacked != isinstance(v_caches, mx.array):
        raise ValueError("k_caches and v_caches must both be lists of a cache a layer, or both stacked arrays")
    if stacked:
        if table is not None:
            raise ValueError("token_block's batch form (a table) takes each layer's pool in a list")
        for name, c in (("k_caches", k_caches), ("v_caches", v_caches)):
            if c.ndim != 4 or c.shape[0] != layers:
                raise ValueError(f"stacked {name} must be [{layers}, Hkv, max_seq, D] (a layer each), got "
                                 f"{tuple(c.shape)}")
        if tuple(v_caches.shape) != tuple(k_caches.shape):
            raise ValueError(f"stacked k_caches and v_caches must have one shape, got {tuple(k_caches.shape)} and "
                             f"{tuple(v_caches.shape)}")
    elif len(k_caches) != layers or len(v_caches) != layers:
        raise ValueError(f"token_block takes a K and a V cache for each of the {layers} layers, got "
                         f"{len(k_caches)} and {len(v_caches)}")
    prompt = table is None and x.ndim == 2 and x.shape[0] > 1
    if x.ndim != 2 or not 1 <= x.shape[0] <= BATCH_ROWS:
        raise ValueError(f"token_block takes 1..{BATCH_ROWS} rows (x [M, d_model]: a token, a prompt's tokens, or a "
                         f"batch's with a table), got {tuple(x.shape)}")
    if after is not None and not prompt:
        raise ValueError("after orders token_block's prompt form (rows of one sequence) after the launch before")
    if prompt and (post or not backends.cross_group_waits()):
        raise ValueError("token_block's prompt form (rows of one sequence) runs in one launch (waits between "
                         "threadgroups) and without post-block norms (one stream row)")
    if share < 1 or (share > 1 and table is None):
        raise ValueError(f"share must be at least 1, and above 1 only in the batch form (a table), got {share}")
    if table is not None and post:
        raise ValueError("token_block's batch form (a table) runs layers without post-block norms")
    if table is not None and not backends.cross_group_waits():
        raise ValueError("token_block's batch form (a table) runs in one launch only (waits between threadgroups)")
    if timeline is not None and not backends.cross_group_waits():
        raise ValueError("a timeline stamps token_block's one launch on CUDA (%globaltimer); on Metal its phases "
                         "run as separate launches, and no timer is read in a kernel")
    mats = (w.w_qkv, w.w_o, w.w_gate_up, w.w_down) + ((w.w_v,) if w.w_v is not None else ())
    if any(s.layers != layers for s in mats):
        raise ValueError(f"token_block's stacks must have {layers} layers each, got {[s.layers for s in mats]}")
    norms = (w.attn_norm, w.ffn_norm) + ((w.q_norm, w.k_norm) if w.q_norm is not None else ()) + (
        (w.post_attn_norm, w.post_ffn_norm) if post else ())
    if any(n.ndim != 2 or n.shape[0] != layers for n in norms) or (
            post and any(tuple(n.shape) != tuple(w.attn_norm.shape) or n.dtype != mx.float16 for n in norms[-2:])):
        raise ValueError(f"token_block's norms must be [{layers}, width], got {[tuple(n.shape) for n in norms]}")
    for caches in ((k_caches, v_caches) if not stacked else ()):
        for c in caches:
            if tuple(c.shape) != tuple(caches[0].shape) or c.dtype != caches[0].dtype:
                raise ValueError(f"every layer's cache must be {caches[0].dtype} {tuple(caches[0].shape)}, got "
                                 f"{c.dtype} {tuple(c.shape)}")
    head = (w.q_norm[0], w.k_norm[0]) if w.q_norm is not None else (None, None)
    # each half checked on layer 0 (the others share its shapes), then given every layer's arrays
    v_of = (lambda i: w.w_v.layer(i)) if w.w_v is not None else (lambda i: None)  # noqa: E731
    ffn = _FFN(x, w.ffn_norm[0], eps, w.w_gate_up.layer(0), w.w_down.layer(0), wide=post,
               max_m=gemv.MAX_M if table is None and not prompt else BATCH_ROWS)
    # (a stack's layer 0 as a slice: its shape for the checks, not a gather's copy)
    k0, v0 = (k_caches[:1].reshape(k_caches.shape[1:]), v_caches[:1].reshape(v_caches.shape[1:])) if stacked else (
        k_caches[0], v_caches[0])
    attn = _Attention(x, w.attn_norm[0], eps, w.w_qkv.layer(0), w.w_o.layer(0), k0, v0, pos,
                      n_heads, theta, neox, *head, counters, split_from, v_of(0), wide=post, table=table, prompt=prompt)
    d = attn.head_dim // 2
    if inv_freqs is not None and (inv_freqs.dtype != mx.float32 or tuple(inv_freqs.shape) not in ((d,), (layers, d))):
        raise ValueError(f"inv_freqs must be float32 [{d}] or [{layers}, {d}], got {inv_freqs.dtype} "
                         f"{tuple(inv_freqs.shape)}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    plain = scale is None or abs(scale - attn.head_dim ** -0.5) < 1e-12 * scale
    if not backends.cross_group_waits() and (layer_kind != LLAMA or inv_freqs is not None or not plain):
        # the phases apart take the llama / qwen3 layer (the fused decode variant runs the others)
        raise ValueError("token_block's phases apart (no waits between threadgroups here) run the llama / qwen3 "
                         "layer at its base's RoPE and 1 / sqrt(D) only")
    if not backends.cross_group_waits():
        if stacked:  # layer views of the stacks, written in place, then the stacks ordered after them
            views = [runtime.layer_views(c, f"token_block's {n}") for n, c in (("k_caches", k_caches),
                                                                            ("v_caches", v_caches))]
            x, k_new, v_new = token_block(x, weights, eps, qtype, *views, pos, n_heads=n_heads, theta=theta,
                                          neox=neox, queue=queue, counters=counters, split_from=split_from)
            return x, depends(k_caches, k_new), depends(v_caches, v_new)
        k_caches, v_caches = list(k_caches), list(v_caches)
        for i in range(layers):
            attn = _Attention(x, w.attn_norm[i], eps, w.w_qkv.layer(i), w.w_o.layer(i), k_caches[i],
                              v_caches[i], pos, n_heads, theta, neox, *((w.q_norm[i], w.k_norm[i]) if head[0]
                                                                         is not None else (None, None)),
                              counters, split_from, v_of(i))
            x, k_caches[i], v_caches[i] = _attention_apart(x, eps, qtype, attn)
            x = _ffn_apart(x, eps, qtype, _FFN(x, w.ffn_norm[i], eps, w.w_gate_up.layer(i), w.w_down.layer(i)))
        return x, k_caches, v_caches
    ffn.norm, ffn.up_data, ffn.down_data = w.ffn_norm, w.w_gate_up.data, w.w_down.data
    attn.norm, attn.qkv_data, attn.o_data = w.attn_norm, w.w_qkv.data, w.w_o.data
    ffn.types = {UP: w.w_gate_up.qtypes, DOWN: w.w_down.qtypes}
    attn.types = {QKV: w.w_qkv.qtypes, O: w.w_o.qtypes}
    if w.w_v is not None:
        attn.v_data, attn.types[V] = w.w_v.data, w.w_v.qtypes
    attn.k_caches, attn.v_caches = ([k_caches], [v_caches]) if stacked else (list(k_caches), list(v_caches))
    attn.stacked = stacked
    if head[0] is not None:
        attn.norms = (w.q_norm, w.k_norm)
    strides = dict(W_QKV_STRIDE=w.w_qkv.stride, W_O_STRIDE=w.w_o.stride, W_UP_STRIDE=w.w_gate_up.stride,
                   W_DOWN_STRIDE=w.w_down.stride, NORM_STRIDE=w.attn_norm.shape[1],
                   HEAD_NORM_STRIDE=w.q_norm.shape[1] if head[0] is not None else 0,
                   **({"W_V_STRIDE": w.w_v.stride} if w.w_v is not None else {}))
    attn.inv_freqs, attn.windows = inv_freqs, tuple(int(v) for v in windows) if layer_kind.windows else None
    attn.scale = attn.scale if scale is None else scale
    if w.qkv_bias is not None and (w.qkv_bias.dtype != mx.float16 or tuple(w.qkv_bias.shape) != (layers, attn.n_qkv)):
        raise ValueError(f"qkv_bias must be float16 [{layers}, {attn.n_qkv}], got {w.qkv_bias.dtype} "
                         f"{tuple(w.qkv_bias.shape)}")
    out = _launch(x, eps, qtype, QKV, 5 * layers, ffn, attn, queue, strides, layer_kind,
                  (w.post_attn_norm, w.post_ffn_norm) if post else None, w.qkv_bias, timeline, share, after)
    if post:  # the stream after the last attention block, and the last FFN's output: its post-norm
        x_out = loop.post_norm_add(out[-1], w.post_ffn_norm[layers - 1], eps, out[4])
    else:
        x_out = out[1]
    if stacked:
        k_caches, v_caches = depends([k_caches, v_caches], [x_out])
        return x_out, k_caches, v_caches
    caches = depends([*k_caches, *v_caches], [x_out])
    return x_out, caches[:layers], caches[layers:]


def _attention_apart(x: mx.array, eps: float, qtype: str, a: _Attention) -> tuple[mx.array, mx.array, mx.array]:
    """attention_block's phases as separate launches (Metal: no waits between threadgroups)."""
    qkv = gemv.rmsnorm_gemv(x, a.norm, eps, a.w_qkv, a.w_qkv.qtype, a.n_qk, a.d)
    if a.w_v is not None:  # V's rows apart (another block type): one GEMV each, then joined
        v = gemv.rmsnorm_gemv(x, a.norm, eps, a.w_v, a.w_v.qtype, a.n_kv * a.head_dim, a.d)
        qkv = mx.concatenate([qkv, v], axis=1)
    head_norm = a.q_norm is not None
    o, k_cache, v_cache = attention.rope_flash_decode(
        qkv, a.k_caches[0], a.v_caches[0], a.raw_pos, 1.0 / math.sqrt(a.head_dim), n_heads=a.n_heads, theta=a.theta,
        neox=a.neox, counters=a.counters, split_from=a.split_from, q_norm=a.q_norm, k_norm=a.k_norm,
        eps=eps if head_norm else None)
    x_out = gemv.gemv_v3(o.reshape(1, -1), a.w_o, a.w_o.qtype, a.d, a.n_heads * a.head_dim, residual=x)
    return x_out, k_cache, v_cache


def _ffn_apart(x: mx.array, eps: float, qtype: str, f: _FFN) -> mx.array:
    """ffn_block's phases as separate launches (Metal)."""
    act = gemv.gate_up_swiglu(x, f.w_gate_up, f.w_gate_up.qtype, 2 * f.f, f.d, gamma=f.norm, eps=eps)
    return gemv.gemv_v3(act, f.w_down, f.w_down.qtype, f.d, f.f, residual=x)
