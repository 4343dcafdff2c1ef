"""The decode loop's kernel variants (device-verified on the H200: tests/test_kernel_decode.py).

- `unfused`: one of lathe's kernels per op: embedding, RMSNorm, the Q4_0/Q8_0 GEMV (`linear`),
  RoPE + KV write (in place), flash decode, SwiGLU; residual adds are MLX adds.
- `megafused`: a decode token's layers in one launch, kernels.blocks' token_block over
  each layer's attention block (RMSNorm + QKV, Qwen3's head norms, RoPE + KV write, attention, O +
  residual) and FFN block (RMSNorm + gate|up + SiLU, down + residual), the weights stacked at load;
  with mega_span=layer, a launch a layer (layer_block: a layer's FFN block and the next layer's
  attention block; layer 0's attention block and the last FFN block alone). The embedding and
  the head as fused's.
  A head of one row (a decode token's, a prompt's last row) on repacked weights also gives the
  greedy token in its launch (the head_argmax option), which greedy() returns with its logits.
  Contiguous cache, repacked weights; prompts and 2-4 token steps run fused's plan. Each GEMV
  runs in its matrix's own block type, layer by layer (llama.cpp's Q4_K_M: Q6_K attn_v and
  ffn_down in some layers; V's rows then a matrix apart from [q; k] in every layer). Where one
  launch may not wait on another's threadgroups (Metal: kernels.backends.cross_group_waits) the
  blocks run their phases as separate launches, and the plan says so.
- `fused`: RMSNorm folded into one QKV GEMV and one gate+up GEMV over concatenated matrices,
  a decode token's RoPE + KV write folded into the attention launch (Llama; Qwen3's head norms
  fold into a RoPE + KV write of their own), SiLU folded into the gate+up GEMV's epilogue on
  repacked weights (into the down GEMV's staging otherwise: the `swiglu_at` option), the final
  norm into the output GEMV. Where a fused projection's parts differ in block type (llama.cpp's
  Q4_K_M: attn_v Q6_K in some layers beside Q4_K attn_q and attn_k), its two matrices run as one
  GEMV launch on repacked weights (kernels.gemv's pair, w_b), or one GEMV a type joined by
  mx.concatenate (the `mixed_projection` option, and GGUF blocks).

Gemma-style layers (harness.program.arch: embedding scale, post-block norms) keep the residual stream in
float32 (wide_stream; the RMSNorm kernels and the v3 GEMVs' RMSNorm prologue read it), each
post-norm an RMSNorm of the block's output added to it (post_norm_add); GELU rides where SiLU
does; sliding-window layers pass their window to the attention kernels; RoPE takes a table a
layer where the layers' bases differ.

KV cache (`kv=`): `contiguous` (head-major [Hkv, max_seq, D] per layer, the default) or `paged`
(vLLM's block pool, blocks of BLOCK_SIZE tokens handed out in a fixed shuffled order through a
block table, unused slots NaN so that a read past the context shows): unfused, RoPE of q and
of k, then reshape_and_cache; fused, both and the write at the token's slot in one launch
(rope_paged_kv_write); then paged_attention (a prompt: prefill_attention over the pool).

Same interface as harness.program.decode.ReferenceDecoder (forward, reset, pos), so generate() and Session
run them, in every mode (compiled: KernelDecoder.compiled_step). Matrices stay in their GGUF
blocks; F16 matrices (the f16 presets) go through MLX's matmul.

The plan is the program: `kernel_plan` builds, once per decoder and phase (a decode token; 2-4
tokens, which the fused GEMVs still take; a longer prompt, which takes the batched GEMV path and
kernels.attention.prefill_attention), the ordered steps with what executes each, and forward()
replays them (harness.program.plan.replay). `--show-plan` prints the decode token's plan, and a CPU test
holds the launches forward() makes against it.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import numpy as np

from harness.program.plan import Step, replay
from harness.program.models import Model
from reference import formats
from reference.model import layer_rope
from kernels import attention, backends, blocks, gemv, loop, options, rope
from kernels.runtime import depends, index, layer_views, prepare, recording, resident

VARIANTS = ("unfused", "fused", "megafused")
KV_LAYOUTS = ("contiguous", "paged")
BLOCK_SIZE = 16  # tokens a block of the paged cache (vLLM's default)
FUSED_UP_TO = 4  # rows of X the fused RMSNorm+GEMV takes (kernels.gemv.MAX_M)
# Options of kernels.options shape the fused variant, read when a decoder is built (its plan
# and its forward() agree): rope_in_attention, a decode token's RoPE + KV write inside the
# attention launch (attention.rope_flash_decode); seams, each layer's output projection and the
# next block's RMSNorm+GEMV as one launch (kernels.gemv.seam): O | gate+up, then down | the next
# layer's QKV (or the head), 64 launches a Llama token fewer (kernels/loop/NOTES.md, "Seams, the
# default"); swiglu_at, where silu(gate) * up is computed (gate+up's epilogue or down's staging).


def rope_in_attention(c) -> bool:
    """Whether a fused contiguous decode token's RoPE + KV write rides in its attention launch:
    models without head norms (Qwen3's norm in a RoPE + KV write of its own), unless turned off.
    The plan and the decoder both ask here, so the plan shows what runs."""
    return options.get("rope_in_attention") and not c.head_norm


def repacked() -> bool:
    """Whether a decoder repacks its Q4_0/Q8_0 matrices when it loads (the `repack` option):
    once, on the device (kernels.gemv.repack; the file is never changed), for the v3 GEMVs. The
    embedding keeps its GGUF blocks (the embed kernel reads them); a tied head gets a repacked
    copy of its own."""
    return options.get("repack")


# The fused variant's concatenated projections and their parts (GGUF names without blk.i.)
FUSED_PARTS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}


def fused_runs(types: dict[str, str], i: int, fused: str, split_v: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """The matrices the fused variant makes of layer i's `fused` projection (FUSED_PARTS), as
    (name, the GGUF matrices in it): one, blk.i.<fused>.weight, where its parts share a block
    type; else one a run of consecutive parts of one type (llama.cpp's Q4_K_M gives some layers'
    attn_v Q6_K beside a Q4_K attn_q and attn_k: q|k, then v), named by its parts (one part keeps
    its GGUF name). A GEMV launch takes one block type. `types`: GGUF name -> type, any case.
    split_v (the megafused variant on such a file, split_v_apart): q|k, then v, in every layer,
    so that token_block's stacks hold one shape a layer."""
    parts = [f"blk.{i}.{p}.weight" for p in FUSED_PARTS[fused]]
    kinds = [types.get(p, "q8_0").lower() for p in parts]
    if split_v and fused == "attn_qkv":
        return [(f"blk.{i}.attn_q+attn_k.weight", tuple(parts[:2])), (parts[2], (parts[2],))]
    if len(set(kinds)) == 1:
        return [(f"blk.{i}.{fused}.weight", tuple(parts))]
    runs: list[list[int]] = []
    for j, kind in enumerate(kinds):
        if runs and kinds[runs[-1][0]] == kind:
            runs[-1].append(j)
        else:
            runs.append([j])
    return [(parts[r[0]] if len(r) == 1 else f"blk.{i}.{'+'.join(FUSED_PARTS[fused][j] for j in r)}.weight",
             tuple(parts[j] for j in r)) for r in runs]


def split_v_apart(c, types: dict[str, str]) -> bool:
    """Whether some layer's attn_v has another block type than its attn_q (llama.cpp's Q4_K_M,
    Q5_K_M): the megafused variant then keeps every layer's V rows a matrix apart from [q; k]
    (kernels.blocks' w_v). `types`: GGUF name -> type, any case."""
    kind = lambda name: types.get(name, "q8_0").lower()  # noqa: E731
    return any(kind(f"blk.{i}.attn_v.weight") != kind(f"blk.{i}.attn_q.weight") for i in range(c.n_layers))


def kernel_gaps(c, types: dict[str, str], variant: str = "fused") -> list[str]:
    """What a model's layer or file holds that lathe's kernel variant does not run yet, each named
    (empty: it runs it). unfused and fused map the llama / qwen3 layer, RoPE scalings (a frequency
    table the RoPE kernels take, yarn's cos/sin factor folded into the attention scale), Q/K/V
    biases (an add after the projection), Phi-3's fused QKV and [gate; up] tensors (the fused
    variant's own concatenations, read from the file) and Gemma 3's layer (a float32 residual
    stream: the scaled embedding, post-block norms; GELU; sliding windows in the attention kernels;
    a RoPE base a layer); megafused all of these in token_block (mega_span=token), the llama / qwen3
    layer alone in a launch a layer (mega_span=layer). The other features of
    harness/arch run in the reference variant and the float64 oracle until a kernel maps them."""
    a, mega = c.architecture, variant == "megafused"
    extra_bias = [b for b in c.biases if b == "attn_output"]
    # token_block (mega_span=token) runs Gemma's layer and every RoPE table (kernels.blocks.LayerKind);
    # a launch a layer (mega_span=layer) the llama / qwen3 layer alone
    by_layer = mega and options.get("mega_span") == "layer"
    layer_only = {"the embedding times sqrt(d_model)": a.embed_scale,
                  "post-attention and post-FFN norms": a.post_norms,
                  f"a {a.activation}-gated FFN": a.activation != "silu",
                  f"{c.rope_scaling} RoPE scaling": c.rope_scaling != "none",
                  "rope_freqs.weight factors": c.rope_freqs,
                  f"a RoPE attn_factor of {c.rope_attn_factor:g}": c.rope_attn_factor != 1.0,
                  f"sliding-window layers ({c.sliding_window} tokens)": any(c.layer(i).window for i in range(c.n_layers)),
                  "layers of different RoPE bases": len({c.layer(i).theta for i in range(c.n_layers)}) > 1,
                  f"an attention scale of {c.scale:g}": abs(c.scale - c.head_dim ** -0.5) > 1e-12,
                  f"an attention softcap of {c.attn_softcap:g}": bool(c.attn_softcap),
                  "a fused attn_qkv matrix": a.fused_qkv, "a fused [gate; up] ffn_up matrix": a.fused_gate_up,
                  "Q/K/V biases": bool(c.biases)}
    features = {f"{what} (in a launch a layer; mega_span=token runs it)": by_layer and present
                for what, present in layer_only.items()}
    features.update({f"heads of {c.head_dim} (attention takes {attention.HEAD_DIMS})": c.head_dim not in attention.HEAD_DIMS,
                     f"biases on {', '.join(extra_bias)}": bool(extra_bias),
                     "a float32 residual stream without post-block norms": mega and a.embed_scale != a.post_norms})
    gaps = [what for what, present in features.items() if present]
    odd = sorted({t for t in types.values() if t not in ("F32", "F16") and t.lower() not in QUANTIZED})
    if odd:
        gaps.append(f"{', '.join(odd)} matrices (the GEMVs take {', '.join(q.upper() for q in QUANTIZED)}, and F16)")
    return gaps


def rope_table(c) -> bool:
    """Whether RoPE turns by a frequency table made from the config (linear or yarn scaling,
    rope_freqs factors, an attn_factor) rather than from the base alone."""
    return c.rope_scaling != "none" or c.rope_freqs or c.rope_attn_factor != 1.0


def mega_types(c, types: dict[str, str]) -> str | None:
    """Why the megafused variant cannot run a file's layers, or None where it can: its blocks
    take the v3 GEMVs' block types (any mix in a launch: each GEMV reads X' in its own chunks),
    each projection's layers take at most two (token_block's stacks), and [q; k] and [gate; up]
    are one matrix each (one type a layer). `types`: GGUF name -> type, any case; a part that a
    file holds fused (Phi-3's attn_qkv, its [gate; up] ffn_up) takes the fused matrix's type."""
    fused_in = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv", "ffn_gate": "ffn_up"}

    def kind(name: str) -> str:
        i, part = name.split(".")[1], name.split(".")[2]
        return types.get(name, types.get(f"blk.{i}.{fused_in.get(part, part)}.weight", "q8_0")).lower()

    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    every = {kind(f"blk.{i}.{n}.weight") for i in range(c.n_layers) for n in names}
    if not every <= set(QUANTIZED):
        return f"its blocks take {', '.join(t.upper() for t in QUANTIZED)}; got {', '.join(sorted(t.upper() for t in every))}"
    for joined in (("attn_q", "attn_k"), ("ffn_gate", "ffn_up")):
        if any(len({kind(f"blk.{i}.{n}.weight") for n in joined}) != 1 for i in range(c.n_layers)):
            return f"{' and '.join(joined)} of a layer must share a block type (one matrix in the launch)"
    for n in names:
        if len({kind(f"blk.{i}.{n}.weight") for i in range(c.n_layers)}) > 2:
            return f"{n} has more than two block types over the layers"
    return None


def seams_apply(c, types: dict[str, str]) -> bool:
    """Whether the fused variant's decode tokens run seams (kernels.gemv.seam): unless turned off,
    when every matrix that seams pair is in one block type (both GEMVs of a seam share one
    instantiation: Q4_0, Q8_0, or a K-quant file of one type such as Q6_K; v3 seams with `repack`,
    the K-quants' only form), and where a launch may wait on another's threadgroups (not on
    Metal: kernels.backends.cross_group_waits; the plan then shows the GEMVs apart).
    `types`: GGUF tensor name -> type name, any case."""
    head = "token_embd.weight" if c.tied else "output.weight"
    names = [head] + [f"blk.{i}.{n}.weight" for i in range(c.n_layers)
                      for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    kinds = {types[n].lower() for n in names if n in types}  # Phi-3: attn_qkv, ffn_up hold the parts
    return (options.get("seams") and len(kinds) == 1 and kinds <= set(QUANTIZED) and backends.cross_group_waits()
            and not c.biases  # a seam hands its QKV to the next layer with no step for the biases
            and not wide_stream(c))  # nor takes a float32 residual stream or post-block norms


def wide_stream(c) -> bool:
    """Whether the residual stream is float32 (the reference variant's rule too: Gemma's scaled
    embedding and post-block norms carry it past fp16's 65504; llama.cpp keeps it float32)."""
    return c.architecture.embed_scale or c.architecture.post_norms


QUANTIZED = ("q4_0", "q8_0", *gemv.REPACKED_ONLY)  # our GEMVs' block types (all but Q4_0, Q8_0: repacked only)
# 1 token; 2..FUSED_UP_TO (the fused GEMVs' rows); ..QMM_UP_TO (the quantized GEMM's, fused as the
# GEMVs are where the weights are repacked and prompt_qmm is on; else as a prompt); more; and a
# megafused prompt of up to mega_prompt_rows tokens: token_block's prompt form (rows)
PHASES = ("decode", "short", "gemm", "prompt", "rows")


def phase_of(t: int) -> str:
    return "decode" if t == 1 else "short" if t <= FUSED_UP_TO else "gemm" if t <= gemv.QMM_UP_TO else "prompt"


# qmm_prologue auto: RMSNorm in qmm's prologue below this d_model. Each threadgroup reads all of X
# to work out 1 / rms, so the fused launch costs GPU time with K (the 8B's gate+up: 84 against 50 us
# a layer at 32 rows); a small model's batched step is host-bound, and the launch it saves counts.
QMM_PROLOGUE_BELOW_D = 4096


def qmm_prologue(c) -> bool:
    """Whether a batched step's QKV and gate+up on qmm take RMSNorm as its prologue (option
    qmm_prologue: on, off, or auto by d_model)."""
    value = options.get("qmm_prologue")
    return c.d_model < QMM_PROLOGUE_BELOW_D if value == "auto" else bool(value)


def head_argmax_applies(c, fused: bool, packed: bool, quantized: bool, one_row: bool) -> bool:
    """Whether the head's launch also gives the greedy token (the head_argmax option): a fused plan's
    RMSNorm+GEMV of one row on repacked quantized weights, whose logits nothing changes after it
    (Gemma 2's softcap does)."""
    return (options.get("head_argmax") and fused and packed and quantized and one_row
            and not c.final_softcap)


def last_row_only(last_only: bool | None) -> bool:
    """Whether a prompt's head takes its last row only: `last_only`, or where None the
    prompt_logits option (forward()'s default: every row)."""
    return options.get("prompt_logits") == "last" if last_only is None else bool(last_only)


def kernel_plan(c, fused: bool, paged: bool = False, overflow: bool = False, seams: bool = False,
                rope_attention: bool | None = None, types: dict[str, str] | None = None,
                phase: str = "decode", packed: bool | None = None, mega: bool = False,
                one_launch: bool | None = None, span: str | None = None, f16_copies: bool = False,
                last_only: bool | None = None) -> list[Step]:
    """The steps a forward() of `phase` replays, in order, each with what executes it (one
    dispatch each where it is our kernel; an MLX op where the kernel says so). `overflow`: the
    contiguous cache wraps around (a decode token's RoPE apart from its cache writes); `seams`
    (fused, up to FUSED_UP_TO tokens): each output projection shares its launch with the next
    RMSNorm+GEMV; `rope_attention` (fused): a decode token's RoPE + KV write inside attention
    (default: rope_in_attention); `types`: GGUF tensor name -> block type (default: all Q8_0),
    which decides between our GEMVs and MLX's matmul; `packed` (default: the repack option): the
    quantized matrices repacked at load, run by the v3 GEMVs; `mega` (fused, a decode token over
    the contiguous cache, repacked): each layer as kernels.blocks' two blocks, one launch each
    where `one_launch` (default: kernels.backends.cross_group_waits(), the backend's rule), their
    phases as separate launches otherwise; `span` (default: the mega_span option): "token", every
    layer in one launch (kernels.blocks.token_block), or "layer", a launch a layer; `f16_copies`
    (the prompt_weights option): a prompt's matmuls read fp16 copies made at load, with no
    dequantize launch; `last_only` (default: the prompt_logits option): a prompt's head over its
    last row only. Phase "rows" (mega, span "token", one launch; not Gemma's post-block norms): a
    prompt through token_block's prompt form, blocks.BATCH_ROWS rows a launch."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    rope_attention = rope_in_attention(c) if rope_attention is None else rope_attention
    packed = repacked() if packed is None else packed
    v = "v3" if packed else "v2"  # the GEMV generation that the weights' layout takes
    kinds = {n: t.lower() for n, t in (types or {}).items()}
    split_v = mega and fused and packed and not paged and split_v_apart(c, kinds)  # as the decoder's _concat
    if c.architecture.fused_gate_up:  # Phi-3's ffn_up is [gate; up]: the decoder names it ffn_gate_up
        for i in range(c.n_layers):
            kinds.setdefault(f"blk.{i}.ffn_gate_up.weight", kinds.get(f"blk.{i}.ffn_up.weight", "q8_0"))
    for i in range(c.n_layers):  # the fused matrices' types, as the decoder's _concat gives them
        for projection_name in FUSED_PARTS:
            for name, run in fused_runs(kinds, i, projection_name, split_v):
                kinds.setdefault(name, kinds.get(run[0], "q8_0"))
    kind = lambda name: kinds.get(name, "q8_0")  # noqa: E731
    quant = lambda name: kind(name) in QUANTIZED  # noqa: E731
    arch = c.architecture
    post, act = arch.post_norms, arch.activation  # Gemma: post-block norms, GELU
    act_shown = "GELU" if act == "gelu" else "SiLU"
    windowed = {i for i in range(c.n_layers) if c.layer(i).window}
    shown = lambda name: f" ({kind(name).upper()}{', repacked' if packed else ''})"  # noqa: E731

    def block_shown(layers, parts) -> str:
        """A block's block types: its first matrix's, then the others' (where some layers' are of
        another type, how many: token_block)."""
        names = [f"blk.{i}.{p}.weight" for i in layers for p in parts]
        others: dict[str, dict[str, int]] = {}
        for name in names:
            if kind(name) != kind(names[0]):
                part = others.setdefault(kind(name), {})
                part[name.split(".")[2]] = part.get(name.split(".")[2], 0) + 1
        extra = "".join(f"; {t.upper()}: " + ", ".join(p if len(layers) == 1 else f"{p} in {n} of {len(layers)} layers"
                                                         for p, n in part.items()) for t, part in others.items())
        return f" ({kind(names[0]).upper()}{extra}{', repacked' if packed else ''})"
    # the matrices a layer's blocks read, as the file holds them (Phi-3: fused [q; k; v], [gate; up])
    attn_parts = ("attn_qkv",) if c.architecture.fused_qkv else ("attn_q", "attn_k", "attn_v")
    attn_parts += ("attn_output",)
    ffn_parts = ("ffn_gate_up",) if c.architecture.fused_gate_up else ("ffn_gate", "ffn_up")
    ffn_parts += ("ffn_down",)
    decode, small, rows = phase == "decode", phase in ("decode", "short"), phase == "rows"
    # 5..QMM_UP_TO rows on repacked weights: qmm with the RMSNorm prologue and the gated epilogue
    # (an fp16 residual stream: Gemma's float32 one takes the prompt's steps)
    gemm = (phase == "gemm" and fused and packed and options.get("prompt_qmm") and not f16_copies
            and not wide_stream(c))
    prologue = gemm and qmm_prologue(c)  # else lathe's rmsnorm, then qmm on h
    # ... where that rmsnorm comes right after O's or down's qmm + residual, in the launch that adds
    # qmm's parts (qmm's next_norm; the output norm stays a launch: a prompt's head takes its last rows)
    norm_after = gemm and not prologue and not post and options.get("qmm_norm_after")
    normed = [None]  # the norm whose output h already holds: the rms_norm step that follows is skipped
    wrap = overflow and decode and not paged
    mega = mega and fused and (decode or rows) and packed and not paged and not wrap
    one_launch = backends.cross_group_waits() if one_launch is None else one_launch
    span = options.get("mega_span") if span is None else span
    if rows and not (mega and span == "token" and one_launch and not post):
        raise ValueError("phase 'rows' is a megafused prompt in token_block's prompt form: mega, span 'token', "
                         "one launch, repacked weights over the contiguous cache, no post-block norms")
    seams = seams and fused and small and not mega
    head = "token_embd.weight" if c.tied else "output.weight"
    last_only = not decode and last_row_only(last_only)  # a prompt's head over its last row
    steps: list[Step] = []

    def add(op, kernel, reads, writes, run, *args, weights=(), per_token=(), layer=None, launches=()):
        steps.append(Step(op, kernel, tuple(reads), tuple(writes), tuple(weights), tuple(per_token), layer,
                          functools.partial(run, *args) if args else run, tuple(launches)))

    # a prompt of up to QMM_UP_TO rows on repacked weights: the quantized GEMM (kernels.gemv.qmm)
    qmm_launch = ("lathe_qmm",) if packed and options.get("prompt_qmm") else ()
    qmm_shown = f"lathe qmm up to {gemv.QMM_UP_TO} rows, else " if qmm_launch else ""

    def linear(src, dst, name, layer=None, residual=False, next_norm=None):
        """Y = X @ W^T (+ the residual stream, in the GEMV's epilogue where it can, in MLX's
        matmul (addmm) for a fused prompt); `next_norm`: the norm that follows, taken into qmm's
        residual epilogue where norm_after."""
        if quant(name) and residual and norm_after and next_norm:
            add("linear_residual_rmsnorm", f"lathe qmm{shown(name)} + residual + RMSNorm ({next_norm.split('.')[-2]})",
                (src, "x"), ("x", "h"), _run_linear_residual_norm, src, name, next_norm, weights=(name, next_norm),
                layer=layer, launches=("lathe_qmm_split", "lathe_qmm_reduce_residual_norm"))
            normed[0] = next_norm
            return
        if quant(name) and residual and fused and small:
            add("linear_residual", f"lathe gemv_{v}{shown(name)} + residual", (src, "x"), ("x",), _run_linear_residual,
                src, name, weights=(name,), layer=layer, launches=(f"lathe_gemv_{v}_residual",))
            return
        if quant(name) and residual and fused:  # a prompt: x + X @ W^T as one matmul
            what = f"F16 copy of{shown(name)}" if f16_copies else f"lathe dequantize{shown(name)}"
            add("linear_residual", f"{qmm_shown}mx.addmm (x + X @ W^T, W the {what})", (src, "x"), ("x",),
                _run_linear_add, src, name, weights=(name,), layer=layer,
                launches=() if f16_copies else (f"lathe_gemv_{v}", "lathe_dequantize", *qmm_launch))
            return
        if not quant(name):
            kernel, launches = "mx.matmul (F16)", ()
        elif not small and f16_copies and not (name == head and last_only):
            # MLX's matmul alone, on the copy made at load (a head over the last row stays a GEMV)
            kernel, launches = f"mx.matmul (F16 copy of{shown(name)})", ()
        else:  # linear()'s paths
            kernel = f"lathe gemv_{v}{shown(name)}" if small else f"{qmm_shown}lathe gemv_{v}{shown(name)}"
            launches = (f"lathe_gemv_{v}",) if small else (f"lathe_gemv_{v}", "lathe_dequantize", *qmm_launch)
        add("linear", kernel, (src,), (dst,), _run_linear, src, dst, name, weights=(name,), layer=layer,
            launches=launches)
        if residual:
            add("add", "mx.add", ("x", dst), ("x",), _run_add, dst, layer=layer)

    def block_out(src, dst, name, i, norm, next_norm=None):
        """A block's output projection into the residual stream: in the GEMV's epilogue (with the
        RMSNorm `next_norm` that follows, where norm_after), or (post_norms) RMS-normed first and
        added to the float32 stream."""
        if not post:
            linear(src, dst, name, i, residual=True, next_norm=next_norm)
            return
        linear(src, dst, name, i)
        post_norm(dst, norm, i)

    def post_norm(src, norm, i):
        add("post_norm_add", "lathe post_norm_add (float32 stream)", (src, "x"), ("x",), _run_post_norm_add, src,
            norm, weights=(norm,), layer=i, launches=("lathe_post_norm_add",))

    def rms_norm(norm, layer=None):
        """RMSNorm of the residual stream into h (none where the step before wrote it: norm_after)."""
        if normed[0] == norm:
            normed[0] = None
            return
        add("rms_norm", "lathe rmsnorm", ("x",), ("h",), _run_rmsnorm, norm, weights=(norm,), layer=layer,
            launches=("lathe_rmsnorm",))

    def norm_linear(norm, name, dst, layer=None, label=None):
        """RMSNorm of the residual stream, then a projection: one launch where the GEMV (or, for
        5..QMM_UP_TO rows, the quantized GEMM) fuses it."""
        if prologue and quant(name) and name != head:
            add("rmsnorm_linear", f"lathe qmm + RMSNorm prologue{shown(name)}", ("x",), (dst,), _run_norm_qmm, norm,
                name, dst, weights=(norm, label or name), layer=layer, launches=("lathe_qmm_norm",))
            return
        if fused and (small or (name == head and last_only)) and quant(name):  # (a prompt's head: its last row)
            add("rmsnorm_linear", f"lathe rmsnorm_gemv_{v}{shown(name)}", ("x",), (dst,), _run_norm_linear, norm, name, dst,
                weights=(norm, label or name), layer=layer, launches=(f"lathe_rmsnorm_gemv_{v}",))
        else:
            rms_norm(norm, layer)
            linear("h", dst, name, layer)

    def projection(norm, which, dst, i):
        """The fused variant's RMSNorm, then layer i's fused projection `which` (fused_runs): one
        matrix, or one a block type with their outputs joined."""
        runs = fused_runs(kinds, i, which, split_v)
        if len(runs) == 1:
            parts = "|".join(p.split("_")[1] for p in FUSED_PARTS[which])
            norm_linear(norm, runs[0][0], dst, i, label=f"blk.{i}.{which} ({parts})")
            return
        names = [name for name, _ in runs]
        if (small and packed and len(runs) == 2 and all(map(quant, names))
                and options.get("mixed_projection") == "pair"):  # both matrices in one launch
            both = "; ".join(f"{kind(name).upper()}: {'|'.join(p.split('.')[2].split('_')[1] for p in run)}"
                             for name, run in runs)
            add("rmsnorm_linear", f"lathe rmsnorm_gemv_{v} pair ({both}, repacked)", ("x",), (dst,),
                _run_norm_linear_pair, norm, *names, dst, weights=(norm, *names), layer=i,
                launches=(f"lathe_rmsnorm_gemv_{v}_pair",))
            return
        outs = tuple(f"{dst}.{j}" for j in range(len(runs)))
        if not small:  # a prompt: the norm once, then each part
            rms_norm(norm, i)
        for (name, _), out in zip(runs, outs):
            if small:
                norm_linear(norm, name, out, i)
            else:
                linear("h", out, name, i)
        add("concat", "mx.concatenate (one GEMV a block type)", outs, (dst,), _run_concat, outs, dst, layer=i)

    wide = wide_stream(c)
    scaled = " x sqrt(d_model)" if arch.embed_scale else ""
    add("embed", f"lathe embed ({kinds.get('token_embd.weight', 'q8_0').upper()})"
        + (f"{scaled}, float32 stream (MLX ops)" if wide else ""), ("token",), ("x",), _run_embed,
        weights=("token_embd.weight",), per_token=("token",), launches=("lathe_embed",))
    for i in range(c.n_layers):
        b = f"blk.{i}."
        if mega and span == "token":
            if i == 0:
                # Gemma's layer: each block's output post-normed into the float32 stream by the
                # phase after it, the last one's by a launch of its own (loop.post_norm_add)
                attend = (("head norms + " if c.head_norm else "") + "RoPE + KV write + attention"
                          + (f" (window {c.sliding_window} in {len(windowed)} of {c.n_layers} layers)" if windowed else ""))
                qkv_what = "rmsnorm+QKV" + ("+biases" if c.biases else "")
                what = (f"every layer: post-norm + {qkv_what} | {attend} | O | post-norm + rmsnorm+gate|up+{act_shown}"
                        " | down; then the last post-norm" if post else
                        f"every layer: {qkv_what} | {attend} | O + residual | rmsnorm+gate|up+{act_shown} | down + residual")
                layer_weights = tuple(w for j in range(c.n_layers) for w in _attention_weights(c, j) + (
                    f"blk.{j}.ffn_norm.weight", f"blk.{j}.ffn_gate_up (gate|up)", f"blk.{j}.ffn_down.weight") + (
                    (f"blk.{j}.post_attention_norm.weight", f"blk.{j}.post_ffw_norm.weight") if post else ()))
                shown_all = block_shown(range(c.n_layers), attn_parts + ffn_parts)
                if rows:  # a prompt's tokens, BATCH_ROWS a launch
                    what += f"; the prompt's rows, {blocks.BATCH_ROWS} a launch"
                add("token_block", f"lathe token_block{shown_all} ({what})" if one_launch else
                    f"token_block's phases apart ({what}: {5 * c.n_layers} launches)",
                    ("x", "cache.*"), ("x", "cache.*"), _run_token_block, last_only, weights=layer_weights,
                    per_token=("pos",),
                    launches=(("lathe_token_block",) + (("lathe_post_norm_add",) if post else ()) if one_launch
                              else _ATTENTION_APART + _FFN_APART))
            continue
        if mega:
            # layer 0's attention block, then each layer's FFN block with the next layer's
            # attention block (one launch a layer), the last layer's FFN block alone
            attention_what = ("rmsnorm+QKV | " + ("head norms + " if c.head_norm else "") +
                              "RoPE + KV write + attention | O + residual")
            ffn_what = "rmsnorm+gate|up+SiLU | down + residual"
            ffn_weights = (b + "ffn_norm.weight", b + "ffn_gate_up (gate|up)", b + "ffn_down.weight")
            if i == 0:
                add("attention_block", f"lathe attention_block{block_shown([0], attn_parts)} ({attention_what})"
                    if one_launch else
                    f"attention_block's phases apart ({attention_what}: 3 launches)", ("x", "cache.0"),
                    ("x", "cache.0"), _run_attention_block, weights=_attention_weights(c, 0), per_token=("pos",),
                    layer=0, launches=("lathe_attention_block",) if one_launch else _ATTENTION_APART)
            if i + 1 < c.n_layers:
                nb = f"cache.{i + 1}"
                both = block_shown([i], ffn_parts)[:-1] + f"; layer {i + 1}:" + block_shown([i + 1], attn_parts)[1:]
                add("layer_block", f"lathe layer_block{both} ({ffn_what} | layer {i + 1}: {attention_what})"
                    if one_launch else "layer_block's phases apart (5 launches)", ("x", nb), ("x", nb),
                    _run_layer_block, i, weights=ffn_weights + _attention_weights(c, i + 1), per_token=("pos",),
                    layer=i, launches=("lathe_layer_block",) if one_launch else _FFN_APART + _ATTENTION_APART)
            else:
                add("ffn_block", f"lathe ffn_block{block_shown([i], ffn_parts)} ({ffn_what})" if one_launch else
                    f"ffn_block's phases apart ({ffn_what}: 2 launches)", ("x",), ("x",), _run_ffn_block, i,
                    weights=ffn_weights, layer=i, launches=("lathe_ffn_block",) if one_launch else _FFN_APART)
            continue
        # -- Q, K and V (rotated or not yet), into the cache, and attention -------------------------
        if seams and i > 0:
            pass  # this layer's QKV came out of the last seam of the layer before
        elif fused:
            projection(b + "attn_norm.weight", "attn_qkv", "qkv", i)
        elif c.architecture.fused_qkv:  # the file's [q; k; v] matrix, sliced after
            rms_norm(b + "attn_norm.weight", i)
            linear("h", "qkv", b + "attn_qkv.weight", i)
        else:
            rms_norm(b + "attn_norm.weight", i)
            for n in "qkv":
                linear("h", n, b + f"attn_{n}.weight", i)
        if c.biases:  # Qwen2's (llama's where a file has them): Q, K and V biases, one add
            parts = ("qkv",) if fused else tuple("qkv")
            add("bias", "mx.add (q|k|v biases)", parts, parts, _run_bias, i,
                weights=tuple(b + f"attn_{n}.bias" for n in "qkv"), layer=i)
        apart = paged or wrap  # RoPE in launches of its own, then the cache writes
        # Head norms as launches of their own: unfused, and fused over a wrapping cache; the fused
        # contiguous and paged paths take them in their RoPE + K/V write
        if not fused or wrap:
            if c.head_norm:
                for n in "qk":
                    add("head_norm", "lathe head_rmsnorm", (n,), (n,), _run_head_norm, n, i,
                        weights=(b + f"attn_{n}_norm.weight",), layer=i, launches=("lathe_head_rmsnorm",))
        if paged and fused:  # (the head norms,) RoPE of q and k, K and V at the token's slot: one launch
            add("rope_kv_write", "lathe rope_paged_kv_write" + (" (NeoX)" if c.neox else "")
                + (" + head norms" if c.head_norm else ""), ("q", "k", "v"), ("q", f"cache.{i}"),
                _run_rope_paged_kv_write, i, per_token=("pos", "slot"), layer=i,
                weights=(b + "attn_q_norm.weight", b + "attn_k_norm.weight") if c.head_norm else (),
                launches=("lathe_head_norm_rope_kv_write_paged" if c.head_norm else "lathe_rope_kv_write_paged",))
        elif apart:
            for n in "qk":
                add("rope", "lathe rope_neox" if c.neox else "lathe rope", (n,), (n,), _run_rope, n, i, per_token=("pos",),
                    layer=i, launches=("lathe_rope",))
        if paged:
            if not fused:
                add("kv_write", "lathe reshape_and_cache", ("k", "v"), (f"cache.{i}",), _run_reshape_and_cache, i,
                    per_token=("slot",), layer=i, launches=("lathe_reshape_and_cache",))
            add("attention", "lathe paged_attention v2 (split past 2048, merged: attn_combine)" if decode else "lathe prefill_attention (paged; kernel: attn_prefill)",
                ("q", f"cache.{i}", "block_table"), ("o",), _run_paged_attention, i, per_token=("kv_len",), layer=i,
                launches=("lathe_paged_attention", "lathe_attention_combine") + (() if decode else ("lathe_paged_prefill",)))
        elif wrap:
            for n in "kv":
                add("kv_write", "lathe cache_write", (n,), (f"cache.{i}",), _run_cache_write, n, i,
                    per_token=("pos % max_seq",), layer=i, launches=("lathe_cache_write",))
            add("attention", "lathe flash_decode (split past 2048, merged: attn_combine)", ("q", f"cache.{i}"), ("o",),
                _run_wrapping_attention, i, per_token=("min(kv_len, max_seq)",), layer=i,
                launches=("lathe_contiguous_attention", "lathe_attention_combine"))
        elif fused and decode and rope_attention:  # RoPE and the KV write ride in attention
            add("rope_attention", "lathe rope_flash_decode (split past 2048, merged: attn_combine)", ("qkv", f"cache.{i}"),
                ("o", f"cache.{i}"), _run_rope_attention, i, per_token=("pos",), layer=i,
                launches=("lathe_contiguous_rope_attention", "lathe_attention_combine"))
        elif fused and not decode and options.get("rope_in_prefill"):  # the prompt's RoPE + KV write in attention
            write_launch = "lathe_head_norm_rope_kv_write" if c.head_norm else "lathe_rope_kv_write"
            seen = f", window {c.layer(i).window}: apart" if i in windowed else ""
            add("rope_prefill_attention", f"lathe rope_prefill_attention (wgmma, up to 128 tokens{seen}; else "
                f"{write_launch.removeprefix('lathe_')} then prefill_attention)", ("qkv", f"cache.{i}"),
                ("o", f"cache.{i}"), _run_rope_prefill_attention, i,
                weights=(b + "attn_q_norm.weight", b + "attn_k_norm.weight") if c.head_norm else (),
                per_token=("pos",), layer=i,
                launches=(write_launch, "lathe_contiguous_attention", "lathe_attention_combine",
                          "lathe_contiguous_prefill"))
        else:
            if fused and c.head_norm:
                add("rope_kv_write", "lathe head_norm_rope_neox_qkv_write", ("qkv",), ("q", f"cache.{i}"),
                    _run_rope_kv_write, i, weights=(b + "attn_q_norm.weight", b + "attn_k_norm.weight"),
                    per_token=("pos",), layer=i, launches=("lathe_head_norm_rope_kv_write",))
            elif fused:
                add("rope_kv_write", "lathe rope_qkv_write", ("qkv",), ("q", f"cache.{i}"), _run_rope_kv_write, i,
                    per_token=("pos",), layer=i, launches=("lathe_rope_kv_write",))
            else:
                add("rope_kv_write", "lathe rope_batch_kv_write", ("q", "k", "v"), ("q", f"cache.{i}"),
                    _run_rope_kv_write, i, per_token=("pos",), layer=i, launches=("lathe_rope_kv_write",))
            seen = f", window {c.layer(i).window}" if i in windowed else ""
            add("attention", f"lathe flash_decode (split past 2048, merged: attn_combine{seen})" if decode
                else f"lathe prefill_attention (kernel: attn_prefill{seen})",
                ("q", f"cache.{i}"), ("o",), _run_attention, i, per_token=("kv_len",), layer=i,
                launches=("lathe_contiguous_attention", "lathe_attention_combine") + (() if decode else ("lathe_contiguous_prefill",)))
        # -- the output projection and the FFN --------------------------------------------------------
        if seams:
            last = i + 1 == c.n_layers
            nxt = ("output_norm.weight", head) if last else (f"blk.{i + 1}.attn_norm.weight", f"blk.{i + 1}.attn_qkv.weight")
            add("seam", f"lathe seam {v} (gemv + residual | rmsnorm_gemv)", ("o", "x"), ("x", "gate_up"), _run_seam,
                i, False, b + "ffn_norm.weight", b + "ffn_gate_up.weight", "gate_up",
                weights=(b + "attn_output.weight", b + "ffn_norm.weight", b + "ffn_gate_up (gate|up)"), layer=i,
                launches=(f"lathe_seam_{'v3_' if packed else ''}plain",))
            add("seam", f"lathe seam {v} (silu_down_gemv + residual | rmsnorm_gemv)", ("gate_up", "x"),
                ("x", "logits" if last else "qkv"), _run_seam, i, True, *nxt, "logits" if last else "qkv",
                weights=(b + "ffn_down.weight", nxt[0], nxt[1] if last else f"blk.{i + 1}.attn_qkv (q|k|v)"),
                layer=i, launches=(f"lathe_seam_{'v3_' if packed else ''}swiglu",))
            continue
        block_out("o", "attn", b + "attn_output.weight", i, b + "post_attention_norm.weight", b + "ffn_norm.weight")
        gate_up, down, ffn_norm = b + "ffn_gate_up.weight", b + "ffn_down.weight", b + "post_ffw_norm.weight"
        after_down = f"blk.{i + 1}.attn_norm.weight" if i + 1 < c.n_layers else None
        if fused and small and quant(gate_up) and packed and options.get("swiglu_at") == "gate_up":
            # SiLU in gate+up's epilogue: down is a plain GEMV over [t, F]
            add("rmsnorm_linear_swiglu", f"lathe rmsnorm_gemv_swiglu_out_v3{shown(gate_up)} ({act_shown})", ("x",),
                ("a",), _run_norm_gate_up_swiglu,
                b + "ffn_norm.weight", gate_up, weights=(b + "ffn_norm.weight", b + "ffn_gate_up (gate|up)"), layer=i,
                launches=("lathe_rmsnorm_gemv_swiglu_out_v3",))
            block_out("a", "ffn", down, i, ffn_norm)
            continue
        if fused and small and quant(gate_up):
            add("rmsnorm_linear", f"lathe rmsnorm_gemv_{v}{shown(gate_up)}", ("x",), ("gate_up",), _run_norm_linear,
                b + "ffn_norm.weight",
                gate_up, "gate_up", weights=(b + "ffn_norm.weight", b + "ffn_gate_up (gate|up)"), layer=i,
                launches=(f"lathe_rmsnorm_gemv_{v}",))
            if post:  # act(gate) * up into down, then the post-FFN norm and the add
                add("silu_down", f"lathe silu_down_gemv_{v}{shown(down)} ({act_shown})", ("gate_up",), ("ffn",),
                    _run_silu_down, i, weights=(down,), layer=i, launches=(f"lathe_silu_down_gemv_{v}",))
                post_norm("ffn", ffn_norm, i)
                continue
            add("silu_down_residual", f"lathe silu_down_gemv_{v}{shown(down)} + residual",
                ("gate_up", "x"), ("x",), _run_silu_down, i,
                weights=(down,), layer=i, launches=(f"lathe_silu_down_gemv_{v}_residual",))
            continue
        if prologue and quant(gate_up):  # RMSNorm, gate+up and act(gate) * up in one qmm launch
            add("rmsnorm_linear_swiglu", f"lathe qmm + RMSNorm prologue + {act_shown} epilogue{shown(gate_up)}", ("x",),
                ("a",), _run_gate_up_qmm, b + "ffn_norm.weight", gate_up,
                weights=(b + "ffn_norm.weight", b + "ffn_gate_up (gate|up)"), layer=i, launches=("lathe_qmm_norm_",))
            block_out("a", "ffn", down, i, ffn_norm)
            continue
        rms_norm(b + "ffn_norm.weight", i)
        if gemm and quant(gate_up):  # qmm_prologue off: gate+up and act(gate) * up in one qmm launch
            add("linear_swiglu", f"lathe qmm + {act_shown} epilogue{shown(gate_up)}", ("h",), ("a",), _run_gate_up_qmm,
                None, gate_up, weights=(b + "ffn_gate_up (gate|up)",), layer=i, launches=("lathe_qmm_",))
            block_out("a", "ffn", down, i, ffn_norm, after_down)
            continue
        if fused or c.architecture.fused_gate_up:  # a prompt (Phi-3: any step): gate+up, SwiGLU over its rows
            linear("h", "gate_up", gate_up, i)
            add("swiglu", f"lathe swiglu ({act_shown})", ("gate_up",), ("a",), _run_swiglu, ("gate_up",), layer=i,
                launches=("lathe_swiglu",))
        else:
            linear("h", "gate", b + "ffn_gate.weight", i)
            linear("h", "up", b + "ffn_up.weight", i)
            add("swiglu", f"lathe swiglu ({act_shown}, over mx.concatenate of gate, up)", ("gate", "up"), ("a",),
                _run_swiglu, ("gate", "up"), layer=i, launches=("lathe_swiglu",))
        block_out("a", "ffn", down, i, ffn_norm)
    if not seams:  # else the head came out of the last seam
        if last_only:  # the head over one row: a GEMV
            add("last_row", "x[-1:] (the last token's logits only)", ("x",), ("x",), _run_last_row)
        if head_argmax_applies(c, fused, packed, quant(head), decode or last_only):
            add("rmsnorm_linear_argmax", f"lathe rmsnorm_gemv_v3 + argmax{shown(head)}", ("x",),
                ("logits", "next_token"), _run_head_argmax, "output_norm.weight", head,
                weights=("output_norm.weight", head), launches=("lathe_rmsnorm_gemv_v3",))
        else:
            norm_linear("output_norm.weight", head, "logits")
    if c.final_softcap:  # Gemma 2: the logits softcapped, in float32
        cap = c.final_softcap
        add("softcap", f"mx ops: {cap:g} * tanh(logits / {cap:g}) (float32)", ("logits",), ("logits",), _run_softcap)
    return steps


# ---- what the steps execute: run(decoder, env, t, pos, ...) over env's named buffers ----------------
def _run_embed(d, env, t, pos):
    embd = "token_embd.weight"
    env["x"] = loop.embed(d.w[embd], env["token"], d.types[embd] if d.types[embd] != "f32" else "f16",
                          d.config.d_model)
    if d.wide:  # a float32 residual stream (Gemma's passes fp16's range), scaled where the family says
        scale = d.config.d_model ** 0.5 if d.config.architecture.embed_scale else 1.0
        env["x"] = env["x"].astype(mx.float32) * scale


def _run_softcap(d, env, t, pos):
    cap = d.config.final_softcap
    env["logits"] = cap * mx.tanh(env["logits"].astype(mx.float32) / cap)


def _run_post_norm_add(src, norm, d, env, t, pos):
    """A block's output RMS-normed (post_attention_norm, post_ffw_norm) and added to the float32
    residual stream, one launch."""
    env["x"] = loop.post_norm_add(env.pop(src), d.g16[norm], d.config.eps, env["x"])


def _run_rmsnorm(norm, d, env, t, pos):
    env["h"] = loop.rmsnorm(env["x"], d.g16[norm], d.config.eps)


def _run_linear(src, dst, name, d, env, t, pos):
    env[dst] = d._linear(env[src], name)


def _run_concat(parts, dst, d, env, t, pos):
    env[dst] = mx.concatenate([env.pop(p) for p in parts], axis=-1)


def _run_last_row(d, env, t, pos):
    env["x"] = env["x"][-1:]


def _run_add(src, d, env, t, pos):
    env["x"] = env["x"] + env[src]


def _run_linear_add(src, name, d, env, t, pos):
    env["x"] = d._linear(env[src], name, residual=env["x"])


def _run_linear_residual_norm(src, name, norm, d, env, t, pos):
    """x + X @ W^T on qmm, and h = RMSNorm of that sum by the launch that adds qmm's parts."""
    n, k = d.nk[name]
    x = env[src]
    env["x"], env["h"] = gemv.qmm(x, d.qmm_matrix(name, x.shape[0]), d.types[name], n, k, residual=env["x"],
                                  next_norm=(d.g16[norm], d.config.eps))


def _run_linear_residual(src, name, d, env, t, pos):
    env["x"] = gemv.gemv(env[src], d.matrix(name), d.types[name], *d.nk[name], residual=env["x"])


def _run_norm_linear(norm, name, dst, d, env, t, pos):
    n, k = d.nk[name]
    env[dst] = gemv.rmsnorm_gemv(env["x"], d.g16[norm], d.config.eps, d.matrix(name), d.types[name], n, k)


def _run_head_argmax(norm, name, d, env, t, pos):
    """The head over one row and its argmax in one launch: the logits, and the next token for
    Decoder.greedy."""
    n, k = d.nk[name]
    env["logits"], env["next_token"] = gemv.rmsnorm_gemv_argmax(env["x"], d.g16[norm], d.config.eps, d.matrix(name),
                                                                d.types[name], n, k, d.head_scratch)


def _run_norm_linear_pair(norm, name, name_b, dst, d, env, t, pos):
    """A fused projection of two block types: RMSNorm, then both matrices' rows in one launch."""
    n, k = d.nk[name]
    env[dst] = gemv.rmsnorm_gemv(env["x"], d.g16[norm], d.config.eps, d.matrix(name), d.types[name], n, k,
                                 w_b=d.matrix(name_b))


def _run_norm_qmm(norm, name, dst, d, env, t, pos):
    n, k = d.nk[name]
    env[dst] = gemv.qmm(env["x"], d.qmm_matrix(name, env["x"].shape[0]), d.types[name], n, k, gamma=d.g16[norm],
                        eps=d.config.eps, counters=d.qmm_sites.get(name))


def _run_gate_up_qmm(norm, name, d, env, t, pos):
    """act(gate) * up of a [gate; up] matrix in one qmm launch: of RMSNorm(x) in its prologue, or of
    h (norm None: lathe's rmsnorm ran first)."""
    n, k = d.nk[name]
    normed = dict(gamma=d.g16[norm], eps=d.config.eps) if norm else {}
    x = env["x" if norm else "h"]
    env["a"] = gemv.qmm(x, d.qmm_matrix(name, x.shape[0]), d.types[name], n, k,
                        activation=d.config.architecture.activation, counters=d.qmm_sites.get(name), **normed)


def _run_norm_gate_up_swiglu(norm, name, d, env, t, pos):
    env["a"] = gemv.gate_up_swiglu(env["x"], d.matrix(name), d.types[name], *d.nk[name], gamma=d.g16[norm],
                                   eps=d.config.eps, activation=d.config.architecture.activation)


def _run_silu_down(i, d, env, t, pos):
    """down of act(gate) * up: plus the residual stream, or into "ffn" where a post-FFN norm
    comes first (post_norms)."""
    wd, post = f"blk.{i}.ffn_down.weight", d.config.architecture.post_norms
    y = gemv.silu_down_gemv(env["gate_up"], d.matrix(wd), d.types[wd], *d.nk[wd], residual=None if post else env["x"],
                            activation=d.config.architecture.activation)
    env["ffn" if post else "x"] = y


def _run_swiglu(parts, d, env, t, pos):
    gate_up = env[parts[0]] if len(parts) == 1 else mx.concatenate([env[p] for p in parts], axis=-1)
    env["a"] = loop.swiglu(gate_up, d.config.architecture.activation)


def _run_seam(i, second, norm, name, dst, d, env, t, pos):
    """Layer i's first seam (O + residual | RMSNorm+GEMV gate+up) or its second (down of
    silu(gate) * up + residual | RMSNorm+GEMV of the next QKV or the head), one launch."""
    wa = f"blk.{i}." + ("ffn_down.weight" if second else "attn_output.weight")
    n_a, k_a = d.nk[wa]
    env["x"], env[dst] = gemv.seam(env["gate_up" if second else "o"], d.matrix(wa), n_a, k_a, env["x"], d.g16[norm],
                              d.config.eps, d.matrix(name), d.nk[name][0], d.types[wa], swiglu=second,
                              queue=d.queues[i][second])


def _heads_of(d, env, t) -> tuple[mx.array, mx.array, mx.array]:
    """Q, K, V [t, heads, D] from the projections: the fused one's output (split, MLX slices) or
    the three of their own."""
    c, hd = d.config, d.config.head_dim
    if "q" not in env:
        env["q"], env["k"], env["v"] = gemv.split(env["qkv"], (c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd))
    shapes = dict(q=c.n_heads, k=c.n_kv_heads, v=c.n_kv_heads)
    for n in "qkv":
        env[n] = env[n].reshape(t, shapes[n], hd)
    return env["q"], env["k"], env["v"]


def _run_head_norm(n, i, d, env, t, pos):
    _heads_of(d, env, t)
    env[n] = rope.head_rmsnorm(env[n], d.g32[f"blk.{i}.attn_{n}_norm.weight"], d.config.eps)


def _run_bias(i, d, env, t, pos):
    if "qkv" in env and d.fused:
        env["qkv"] = env["qkv"] + d.bias[i]
    else:
        for n, part in zip("qkv", mx.split(d.bias[i], d.qkv_splits)):
            env[n] = env[n] + part


def _run_rope(n, i, d, env, t, pos):
    _heads_of(d, env, t)
    rotate = rope.rope_neox if d.config.neox else rope.rope
    env[n] = rotate(env[n], pos, theta=d.thetas[i], inv_freq=d.inv_freqs[i])


def _run_rope_kv_write(i, d, env, t, pos):
    """RoPE (Qwen3: and the head norms) with the in-place K/V write of t tokens at pos: from the
    fused projection's output where there is one, else from Q, K, V."""
    c, b = d.config, f"blk.{i}."
    if "qkv" in env and d.fused:
        if c.head_norm:
            rot = rope.head_norm_rope_neox_qkv_write(
                env["qkv"], d.g32[b + "attn_q_norm.weight"], d.g32[b + "attn_k_norm.weight"], d.k[i], d.v[i], pos,
                n_heads=c.n_heads, eps=c.eps, theta=d.thetas[i], inv_freq=d.inv_freqs[i])
        else:
            rot = rope.rope_qkv_write(env["qkv"], d.k[i], d.v[i], pos, n_heads=c.n_heads, theta=d.thetas[i],
                                      neox=c.neox, inv_freq=d.inv_freqs[i])
    else:
        write = rope.rope_neox_batch_kv_write if c.neox else rope.rope_batch_kv_write
        rot = write(*_heads_of(d, env, t), d.k[i], d.v[i], pos, theta=d.thetas[i], inv_freq=d.inv_freqs[i])
    d.k[i], d.v[i] = rot.k_cache, rot.v_cache
    env["q"], env["written"] = rot.q, rot.written


def _lens(pos, rows=None):
    """Context lengths of a decode token at pos: host ints, or int32[1] on the device."""
    if isinstance(pos, int):
        return [pos + 1 if rows is None else min(pos + 1, rows)]
    return pos + 1 if rows is None else mx.minimum(pos + 1, rows)


def _run_attention(i, d, env, t, pos):
    """Attention over the contiguous cache after its write: a decode token (flash decode) or a
    prompt (causal, each token over the cache up to its own position)."""
    c, hd, scale = d.config, d.config.head_dim, d.scale
    if t == 1:
        o = attention.flash_decode(env["q"].reshape(1, c.n_heads, hd), d.k[i][None], d.v[i][None], _lens(pos),
                                   scale, after=env["written"], counters=d.attn_counters[i], window=d.windows[i],
                                   softcap=d.config.attn_softcap)
    else:
        o = attention.prefill_attention(env["q"].reshape(t, c.n_heads, hd), d.k[i], d.v[i], pos, scale,
                                        after=env["written"], window=d.windows[i], softcap=c.attn_softcap)
    _end_layer_attention(env, o.reshape(t, -1))


def _run_rope_prefill_attention(i, d, env, t, pos):
    """A prompt's (head norms,) RoPE, K/V write and attention: one launch where
    attention.rope_prefill_unavailable names no reason (wgmma, up to 128 tokens, no window or
    softcap), else the RoPE + K/V write launch, then prefill_attention."""
    c = d.config
    if attention.rope_prefill_unavailable(t, c.head_dim, d.windows[i], c.attn_softcap):
        _run_rope_kv_write(i, d, env, t, pos)
        _run_attention(i, d, env, t, pos)
        return
    b = f"blk.{i}."
    norms = dict(q_norm=d.g32[b + "attn_q_norm.weight"], k_norm=d.g32[b + "attn_k_norm.weight"],
                 eps=c.eps) if c.head_norm else {}
    o, d.k[i], d.v[i] = attention.rope_prefill_attention(env["qkv"], d.k[i], d.v[i], pos, d.scale,
                                                          n_heads=c.n_heads, theta=d.thetas[i], neox=c.neox,
                                                          inv_freq=d.inv_freqs[i], **norms)
    _end_layer_attention(env, o.reshape(t, -1))


def _run_rope_attention(i, d, env, t, pos):
    c = d.config
    o, d.k[i], d.v[i] = attention.rope_flash_decode(env["qkv"], d.k[i], d.v[i], pos, d.scale,
                                                     n_heads=c.n_heads, theta=d.thetas[i], neox=c.neox,
                                                     inv_freq=d.inv_freqs[i], counters=d.attn_counters[i],
                                                     window=d.windows[i], softcap=c.attn_softcap)
    _end_layer_attention(env, o.reshape(1, -1))


# what the megafused plan's blocks launch where their phases run apart (kernels.blocks, Metal)
_ATTENTION_APART = ("lathe_rmsnorm_gemv_v3", "lathe_contiguous_", "lathe_attention_combine", "lathe_gemv_v3_residual")
_FFN_APART = ("lathe_rmsnorm_gemv_swiglu_out_v3", "lathe_gemv_v3_residual")


def _attention_weights(c, i: int) -> tuple[str, ...]:
    b = f"blk.{i}."
    norms = (b + "attn_q_norm.weight", b + "attn_k_norm.weight") if c.head_norm else ()
    biases = tuple(b + f"attn_{n}.bias" for n in "qkv") if c.biases else ()
    return (b + "attn_norm.weight", b + "attn_qkv (q|k|v)", *biases, *norms, b + "attn_output.weight")


def _attention_args(d, i: int) -> tuple[tuple, dict]:
    """Layer i's attention block: its positional weights and its keyword arguments."""
    c, b = d.config, f"blk.{i}."
    kw = {n: d.g32[b + f"attn_{n[0]}_norm.weight"] for n in ("q_norm", "k_norm")} if c.head_norm else {}
    if d.split_v:  # [q; k] and v apart (split_v_apart)
        w_qkv, kw["w_v"] = d.matrix(b + "attn_q+attn_k.weight"), d.matrix(b + "attn_v.weight")
    else:
        w_qkv = d.matrix(b + "attn_qkv.weight")
    return ((d.g16[b + "attn_norm.weight"], w_qkv, d.matrix(b + "attn_output.weight")),
            dict(n_heads=c.n_heads, theta=c.rope_theta, neox=c.neox, counters=d.attn_counters[i], **kw))


def _ffn_args(d, i: int) -> tuple:
    b = f"blk.{i}."
    return d.g16[b + "ffn_norm.weight"], d.matrix(b + "ffn_gate_up.weight"), d.matrix(b + "ffn_down.weight")


def _run_attention_block(d, env, t, pos):
    (norm, w_qkv, w_o), kw = _attention_args(d, 0)
    env["x"], d.k[0], d.v[0] = blocks.attention_block(env["x"], norm, d.config.eps, w_qkv, w_o, w_qkv.qtype,
                                                      d.k[0], d.v[0], pos,
                                                      queue=d.block_queues[0], **kw)


def _run_layer_block(i, d, env, t, pos):
    """Layer i's FFN block and layer i + 1's attention block, one launch (the queue is layer i's)."""
    (norm, w_qkv, w_o), kw = _attention_args(d, i + 1)
    env["x"], d.k[i + 1], d.v[i + 1] = blocks.layer_block(
        env["x"], *_ffn_args(d, i), norm, w_qkv, w_o, d.config.eps, d.types[f"blk.{i}.ffn_gate_up.weight"],
        d.k[i + 1], d.v[i + 1], pos, queue=d.block_queues[i + 1], **kw)


def _run_ffn_block(i, d, env, t, pos):
    norm, w_gate_up, w_down = _ffn_args(d, i)
    env["x"] = blocks.ffn_block(env["x"], norm, d.config.eps, w_gate_up, w_down, d.types[f"blk.{i}.ffn_gate_up.weight"],
                                queue=d.block_queues[0])


class StackedCaches:
    """Every layer's K (or V) cache in one array [layers, Hkv, max_seq, D] (megafused's, option
    mega_kv_stacked): token_block takes the stack as one input, so a compiled decode step takes
    and returns two caches instead of 2 x layers, each of which MLX's replay and encoding cost
    host time (kernels/loop/NOTES.md). The plan steps that run a layer at a time (a prompt)
    index it as the list of caches: layer i is a view of the stack (its buffer), and a layer
    written in place is kept, so that `whole()` orders the stack after those writes."""

    def __init__(self, stack: mx.array):
        self.stack = stack
        self._layers: list[mx.array] | None = None
        self._written: list[mx.array] = []

    def __len__(self) -> int:
        return self.stack.shape[0]

    def __getitem__(self, i: int) -> mx.array:
        if self._layers is None:
            self._layers = layer_views(self.stack, "a stacked cache")
        return self._layers[i]

    def __setitem__(self, i: int, cache: mx.array) -> None:
        self[i]  # noqa: B018 (the views, made once)
        self._layers[i] = cache  # the view after a write in place: the same bytes
        self._written.append(cache)

    def whole(self) -> mx.array:
        """The stack, ordered after every layer written through its view."""
        if self._written:
            self.stack, self._layers, self._written = depends(self.stack, self._written), None, []
        return self.stack


def _run_token_block(last_only, d, env, t, pos):
    """Every layer of a decode token in one launch, on the decoder's stacked weights (and, with
    mega_kv_stacked, its stacked caches); a prompt's t tokens (phase rows) blocks.BATCH_ROWS a
    launch in token_block's prompt form, one launch after another (each reads the rows the one
    before wrote), the stream's rows joined (`last_only`: the last launch's, of which the head
    takes the last)."""
    c = d.config
    k, v = (d.k.whole(), d.v.whole()) if d.stacked else (d.k, d.v)
    step, outs = blocks.BATCH_ROWS if t > 1 else 1, []
    for r0 in range(0, t, step):
        x, k, v = blocks.token_block(env["x"][r0:r0 + step] if t > 1 else env["x"], d.stacks, c.eps,
                                     d.stacks.w_qkv.qtypes[0], k, v, pos + r0 if t > 1 else pos,
                                     n_heads=c.n_heads, theta=c.rope_theta, neox=c.neox,
                                     queue=d.token_queue, counters=d.attn_counters[0],
                                     layer_kind=d.layer_kind, inv_freqs=d.stacked_inv_freqs, scale=d.scale,
                                     windows=d.windows if d.layer_kind.windows else None,
                                     timeline=d.timeline, after=outs[-1] if outs else None)
        outs.append(x)
    env["x"] = outs[-1] if last_only or len(outs) == 1 else mx.concatenate(outs)
    d.k, d.v = (StackedCaches(k), StackedCaches(v)) if d.stacked else (k, v)


def _run_cache_write(n, i, d, env, t, pos):
    """K or V of one decode token into row pos % max_seq of a cache that may wrap around."""
    caches = d.k if n == "k" else d.v
    caches[i], written = rope.cache_write(env[n].reshape(1, -1), caches[i], pos % d.max_seq)
    env[f"written.{n}"] = written


def _run_wrapping_attention(i, d, env, t, pos):
    """Attention of one decode token over the min(pos + 1, max_seq) rows the cache holds (their
    order does not matter to softmax)."""
    c = d.config
    o = attention.flash_decode(env["q"].reshape(1, c.n_heads, c.head_dim), d.k[i][None], d.v[i][None],
                               _lens(pos, d.max_seq), d.scale,
                               after=mx.concatenate([env["written.k"], env["written.v"]]), counters=d.attn_counters[i],
                               softcap=c.attn_softcap)
    _end_layer_attention(env, o.reshape(1, -1))


def _run_rope_paged_kv_write(i, d, env, t, pos):
    """RoPE of t tokens at pos.. with their K and V written at their slots of the paged pool."""
    on_device = isinstance(pos, mx.array)  # a compiled step's position: one token
    positions = pos.reshape(1) if on_device else np.arange(pos, pos + t)
    slots = d._slots(pos, t).reshape(-1).astype(mx.int32) if on_device else d._slots(pos, t)
    paged_rope_kv_write(d, i, env, t, positions, slots, _head_norms(d, i))


def paged_rope_kv_write(d, i, env, t, positions, slots, norms: dict) -> None:
    """Layer i's RoPE + K/V write of t tokens into the paged pool, Q left in env: from the fused
    QKV projection's rows where env has them (option paged_qkv_rows), else from Q, K and V."""
    if "qkv" in env and "q" not in env and options.get("paged_qkv_rows"):
        rot = rope.rope_paged_qkv_write(env["qkv"], d.k[i], d.v[i], positions, slots, n_heads=d.config.n_heads,
                                        theta=d.thetas[i], inv_freq=d.inv_freqs[i], neox=d.config.neox, **norms)
    else:
        q, k, v = _heads_of(d, env, t)
        rot = rope.rope_paged_kv_write(q, k, v, d.k[i], d.v[i], positions, slots, theta=d.thetas[i],
                                       inv_freq=d.inv_freqs[i], neox=d.config.neox, **norms)
    d.k[i], d.v[i] = rot.k_cache, rot.v_cache
    env["q"], env["written"] = rot.q, rot.written


def _head_norms(d, i) -> dict:
    """Layer i's per-head RMSNorm weights of Q and K as the RoPE + K/V write launches take them
    (Qwen3's; nothing for a family without them)."""
    if not d.config.head_norm:
        return {}
    return dict(q_norm=d.g32[f"blk.{i}.attn_q_norm.weight"], k_norm=d.g32[f"blk.{i}.attn_k_norm.weight"],
                eps=d.config.eps)


def _run_reshape_and_cache(i, d, env, t, pos):
    _heads_of(d, env, t)
    d.k[i], d.v[i], env["written"] = attention.reshape_and_cache(env["k"], env["v"], d.k[i], d.v[i],
                                                                 d._slots(pos, t))


def _run_paged_attention(i, d, env, t, pos):
    scale = d.scale
    if t == 1:
        table = d.table if isinstance(pos, int) else d.table_dev
        o = attention.paged_attention(env["q"], d.k[i], d.v[i], table, _lens(pos), scale, after=env["written"],
                                      counters=d.attn_counters[i], window=d.windows[i], softcap=d.config.attn_softcap)
    else:
        o = attention.prefill_attention(env["q"], d.k[i], d.v[i], pos, scale, block_table=d.table[0],
                                        after=env["written"], window=d.windows[i], softcap=d.config.attn_softcap)
    _end_layer_attention(env, o.reshape(t, -1))


def _end_layer_attention(env, o: mx.array) -> None:
    """o [t, Hq * D] for the output projection; the layer's Q, K, V and projections are done."""
    for n in ("q", "k", "v", "qkv", "h", "written", "written.k", "written.v"):
        env.pop(n, None)
    env["o"] = o


class KernelDecoder:
    """Prefill and decode with lathe's kernels over a loaded GGUF model (see the module doc)."""

    def __init__(self, model: Model, max_seq: int, variant: str = "fused", kv: str = "contiguous",
                 overflow: bool = False) -> None:
        """`overflow`: decode steps past max_seq wrap around the contiguous cache (circular
        overflow, as the reference variant): token p is written at row p % max_seq over the
        oldest token and attends to all the rows it holds. The fused RoPE + KV write kernels
        take one position for the angle and the row, so such a decoder rotates Q and K in
        launches of their own and writes K and V with cache_write (4 launches a layer more).
        Without it, a decode step past max_seq is a clear error before any launch."""
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if kv not in KV_LAYOUTS:
            raise ValueError(f"kv must be one of {KV_LAYOUTS}, got {kv!r}")
        if overflow and kv == "paged":
            raise ValueError("circular overflow is for the contiguous cache; a paged cache grows by blocks")
        gaps = kernel_gaps(model.config, model.types, variant)
        if gaps:
            other = "fused" if variant == "megafused" and not kernel_gaps(model.config, model.types) else "reference"
            raise ValueError(f"the {variant} variant does not run this {model.config.arch} model's "
                             f"{'; '.join(gaps)}: the {other} variant does (--variant {other})")
        k_types = sorted({t for t in model.types.values() if t.endswith("_K")})
        if k_types and not repacked():
            raise ValueError(f"this model has {', '.join(k_types)} matrices, which lathe's GEMVs read repacked "
                             f"only (the v3 GEMVs): turn the repack option on")
        c = model.config
        if max_seq < 1 or max_seq > c.ctx:
            raise ValueError(f"max_seq must be in 1..{c.ctx} (the model's context), got {max_seq}")
        self.config, self.max_seq, self.variant, self.kv, self.overflow = c, max_seq, variant, kv, overflow
        self.fused, self.paged = variant in ("fused", "megafused"), kv == "paged"
        self.mega = variant == "megafused"
        self.span = options.get("mega_span") if self.mega else None  # its stacks are built for it
        # every layer's K (and V) cache in one array, which token_block reads at each layer's offset
        self.stacked = self.span == "token" and bool(options.get("mega_kv_stacked"))
        # a prompt of 2..prompt_rows tokens in token_block's prompt form (plan_for's phase "rows"):
        # one launch (CUDA), and one stream row for Gemma's post-block norms only (not there)
        self.prompt_rows = (options.get("mega_prompt_rows") if self.span == "token" and backends.cross_group_waits()
                            and not model.config.architecture.post_norms else 0)
        # a list, where token_block's launches should stamp their tickets (harness.tools.block_timeline):
        # each uncompiled step's launch appends its kernels.blocks.BlockTimeline
        self.timeline: list | None = None
        if self.mega and (self.paged or overflow or not repacked()):
            raise ValueError("the megafused variant runs over the contiguous cache, without circular overflow, "
                             "on repacked weights (the repack option)")
        self.types = {n: t.lower() for n, t in model.types.items()}
        self.w, self.nk = {}, {}
        for name, t in model.tensors.items():
            if name.endswith("norm.weight"):
                continue
            if t.dtype == np.uint8:
                per_block = formats.block_weights(model.types[name])
                self.w[name] = resident(mx.array(t))
                self.nk[name] = (t.shape[0], t.shape[1] // formats.row_bytes(model.types[name], per_block) * per_block)
            else:
                self.w[name] = resident(mx.array(np.asarray(t, dtype=np.float16)))
                self.nk[name] = tuple(t.shape)
        norms = [n for n in model.tensors if n.endswith("norm.weight")]
        self.g16 = {n: resident(mx.array(np.asarray(model.tensors[n], dtype=np.float16))) for n in norms}
        self.g32 = {n: resident(mx.array(np.asarray(model.tensors[n], dtype=np.float32))) for n in norms}
        if self.mega and (why := mega_types(c, self.types)):
            raise ValueError(f"megafused cannot run this file's layers: {why} (the fused variant can)")
        # megafused on a file whose attn_v differs in type in some layer: [q; k] and v apart in every layer
        self.split_v = self.mega and split_v_apart(c, self.types)
        a = c.architecture
        if a.fused_gate_up:  # the file's ffn_up is [gate; up]: the matrix the fused variant makes
            for i in range(c.n_layers):
                old, new = f"blk.{i}.ffn_up.weight", f"blk.{i}.ffn_gate_up.weight"
                self.w[new], self.nk[new], self.types[new] = self.w.pop(old), self.nk.pop(old), self.types.pop(old)
        if self.fused and not a.fused_qkv:
            self._concat("attn_qkv", ("attn_q", "attn_k", "attn_v"))
        if self.fused and not a.fused_gate_up:
            self._concat("ffn_gate_up", ("ffn_gate", "ffn_up"))
        self.packed: dict[str, gemv.Packed] = {}  # repacked matrices (the repack option)
        if repacked():
            for name, t in self.types.items():
                if t in QUANTIZED and name in self.w and (name != "token_embd.weight" or c.tied):
                    self.packed[name] = gemv.repack(self.w[name], t, *self.nk[name])
                    if name != "token_embd.weight":
                        del self.w[name]  # the embedding keeps its blocks for the embed kernel
        # The qmm_rows8 option: qmm's launches read RowBlocks, a second copy made here (the GEMVs
        # and megafused's stacks keep the v3 one; a tied head's copy too, the embedding its blocks)
        self.rows8: dict[str, gemv.RowBlocks] = {}
        if options.get("qmm_rows8"):
            for name, w in self.packed.items():
                if w.qtype in ("q4_0", "q8_0") and w.n % 8 == 0 and w.k % 128 == 0:
                    self.rows8[name] = gemv.interleave_rows(w)
        # Each repacked matrix's counters for qmm's in-launch adds (qmm_combine): made here, outside
        # any compiled step's trace; a step's launches on one matrix follow one another
        self.qmm_sites = {name: gemv.qmm_counters(w.n) for name, w in self.packed.items()}
        # The fused head's argmax scratch (head_argmax), made here for the same reason; its launches
        # follow one another by the token's data, or an evaluation between them (_pending_head)
        head = "token_embd.weight" if c.tied else "output.weight"
        self.head_scratch = (gemv.head_argmax_scratch(self.types[head], *self.nk[head])
                             if head in self.packed else None)
        self._fused_head: tuple[mx.array, mx.array] | None = None  # (logits, token) of the last head
        # the last compiled call's logits where it returned no caches (decode_cache_outputs off):
        # its in-place writes run only once something after them is evaluated (_pending_head)
        self._unreturned: list[mx.array] = []
        if self.mega:
            # a launch site's counters: attention_block (layer 0) and the last ffn_block share one,
            # launches ordered by the token's data
            self.block_queues = [blocks.block_queue() for _ in range(c.n_layers)]
            if self.span == "token":
                self._stack_layers()
        # The prompt_weights option: fp16 copies of the matrices a prompt's matmuls read, made
        # once here rather than dequantized by a launch a matrix every prompt
        self.f16: dict[str, mx.array] = {}
        if options.get("prompt_weights") == "f16":
            for step in kernel_plan(c, self.fused, self.paged, self.overflow, False, None, self.types, "prompt",
                                    bool(self.packed), span=self.span, f16_copies=True):
                copied = step.op in ("linear", "linear_residual") and not step.launches  # MLX's matmul alone
                for name in step.weights if copied else ():
                    if self.types.get(name) in QUANTIZED and name not in self.f16:
                        self.f16[name] = gemv.dequantize(self.matrix(name), self.types[name], *self.nk[name])
                        mx.eval(self.f16[name])
        # RoPE by a frequency table where the file scales it, yarn's factor on cos and sin squared
        # into the attention scale (q.k takes it once from each side); a layer's own base and
        # scale where layers differ (Gemma 3: sliding layers at 10000, unscaled): a table a layer
        layers = [c.layer(i) for i in range(c.n_layers)]
        per_layer = len({(layer.theta, layer.freq_scale) for layer in layers}) > 1
        self.inv_freqs, mscale = [None] * c.n_layers, 1.0
        if rope_table(c) or per_layer:
            tables = {}
            for i, layer in enumerate(layers):
                if (layer.theta, layer.freq_scale) not in tables:
                    angles, m_i = layer_rope(model, i)
                    tables[layer.theta, layer.freq_scale] = resident(mx.array(angles.astype(np.float32)))
                    mscale = m_i if i == 0 else mscale
                self.inv_freqs[i] = tables[layer.theta, layer.freq_scale]
        self.inv_freq = self.inv_freqs[0]  # layer 0's (megafused's: one base and scale a model)
        self.thetas = [layer.theta for layer in layers]
        self.scale = c.scale * mscale * mscale
        # sliding-window layers: the attention kernels read each query's last `window` rows of
        # a cache that holds every position (Gemma 3)
        self.windows = [layer.window or 0 for layer in layers]
        if overflow and any(0 < w < max_seq for w in self.windows):
            raise ValueError("circular overflow over sliding-window layers narrower than the cache is not mapped "
                             "(the ring's rows are not in position order): the reference variant runs it")
        self.wide = wide_stream(c)  # a float32 residual stream (Gemma)
        # what megafused's token_block computes beyond the llama layer, and its RoPE table(s)
        a = c.architecture
        self.layer_kind = blocks.LayerKind(a.post_norms, any(self.windows), a.activation, c.attn_softcap or 0.0,
                                           qkv_bias=bool(c.biases))
        self.stacked_inv_freqs = (None if self.inv_freqs[0] is None else
                                  mx.stack(self.inv_freqs) if per_layer else self.inv_freqs[0])
        if c.biases:  # [q; k; v] biases a layer, fp16, added to the projection's output
            q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            self.qkv_splits = [q, q + kv]
            self.bias = [resident(mx.array(np.concatenate([model.tensors[f"blk.{i}.attn_{n}.bias"] for n in "qkv"])
                                           .astype(np.float16))) for i in range(c.n_layers)]
            if self.mega and self.span == "token":  # token_block adds them in its QKV phase
                self.stacks.qkv_bias = mx.stack(self.bias)
                mx.eval(self.stacks.qkv_bias)
        self.seams = self.fused and seams_apply(c, self.types)
        self.rope_attention = self.fused and rope_in_attention(c)
        if self.seams:
            self.queues = [(gemv.seam_queue(), gemv.seam_queue()) for _ in range(c.n_layers)]
        # each layer's attention launch merges its split partitions on counters of its own
        # (layer 0's also token_block's, whose prompt form merges BATCH_ROWS rows' partitions)
        self.attn_counters = [attention.merge_counters(c.n_heads * (blocks.BATCH_ROWS if i == 0 else 1))
                              for i in range(c.n_layers)]
        mx.clear_cache()  # the host-written copies of the weights (kernels.runtime.resident)
        self._plans: dict[tuple[str, bool], list[Step]] = {}
        self.plan = self.plan_for(1)  # a decode token's: --show-plan's, and the dispatches per token
        self.resize(max_seq)

    def _stack_layers(self) -> None:
        """token_block's weights: each projection's matrices of every layer in one buffer, the
        per-layer matrices kept as views of it (no second copy), the norms stacked."""
        c, n = self.config, self.config.n_layers
        stacks = {}
        qkv = ("attn_q+attn_k", "attn_v") if self.split_v else ("attn_qkv",)
        for kind in (*qkv, "attn_output", "ffn_gate_up", "ffn_down"):
            names = [f"blk.{i}.{kind}.weight" for i in range(n)]
            stacks[kind] = blocks.Stack([self.packed.pop(name) for name in names])
            self.packed.update({name: stacks[kind].layer(i) for i, name in enumerate(names)})
        norms = {kind: mx.stack([(self.g32 if kind in ("attn_q_norm", "attn_k_norm") else self.g16)
                                 [f"blk.{i}.{kind}.weight"] for i in range(n)])
                 for kind in ("attn_norm", "ffn_norm") + (("attn_q_norm", "attn_k_norm") if c.head_norm else ())}
        if c.architecture.post_norms:  # Gemma's, fp16 as the other norms
            norms.update({kind: mx.stack([self.g16[f"blk.{i}.{kind}.weight"] for i in range(n)])
                          for kind in ("post_attention_norm", "post_ffw_norm")})
        mx.eval(list(norms.values()))
        self.stacks = blocks.LayerStacks(norms["attn_norm"], stacks[qkv[0]], stacks["attn_output"],
                                         norms["ffn_norm"], stacks["ffn_gate_up"], stacks["ffn_down"],
                                         norms.get("attn_q_norm"), norms.get("attn_k_norm"), stacks.get("attn_v"),
                                         norms.get("post_attention_norm"), norms.get("post_ffw_norm"))
        self.token_queue = blocks.block_queue(5 * n)

    def resize(self, max_seq: int) -> None:
        """An empty cache of max_seq rows, the weights kept (a run over several depths sizes the
        cache for each: a compiled step's attention grid covers the whole cache)."""
        if max_seq < 1 or max_seq > self.config.ctx:
            raise ValueError(f"max_seq must be in 1..{self.config.ctx} (the model's context), got {max_seq}")
        self.max_seq = max_seq
        if self.paged:
            # One sequence's blocks, scattered over the pool in a fixed shuffle: every read and
            # write goes through the table, as with a pool shared by many sequences.
            blocks = -(-max_seq // BLOCK_SIZE)
            self.table = np.random.default_rng(0).permutation(blocks).astype(np.int32)[None]
            self.table_dev = resident(mx.array(self.table))
        self._compiled: dict[bool, Any] = {}  # traced for the old size, by decode_cache_outputs
        self._compiled_prompts: dict[tuple[int, int, bool, bool], tuple[Any, bool]] = {}
        self.reset()
        self._prepared: set[int] = set()
        self.prepare_kernels()

    def prepare_kernels(self, tokens: tuple[int, ...] = (), pos: int = 0) -> int:
        """Compile ahead, in parallel, the kernels that the on-disk kernel cache lacks
        (kernels.jit_cache; CUDA only) for a forward() of each length in `tokens`, recorded
        rather than run; without `tokens`, a decode token's, in both forms (position on the
        host, and on the device as in a compiled step), and the argmax. Returns how many were
        compiled. Constants follow the token count (the fused GEMVs' rows, the prompt's
        kernels), so forward() prepares each new length it meets (at its position: a few
        kernels also change with the cache's length, and compile at their first launch)."""
        held, head = self.cache_arrays(), self._fused_head  # the recorded steps replace them with zeros
        try:
            with recording() as rec:
                for t in tokens:
                    self.layers(list(range(t)), t, pos)
                if not tokens:
                    self.layers([0], 1, 0)
                    self.layers(mx.zeros((1,), mx.int32), 1, index(0))
                    for dtype in (mx.float16, mx.float32):
                        self.greedy(mx.zeros((1, self.config.vocab), dtype))
        finally:
            self.take_caches(held)
            self._fused_head = head
        self._prepared.update(tokens or (1,))
        compiled, _ = prepare(rec.jobs)  # a kernel that fails to compile fails at its launch
        return compiled

    def launches_per_token(self, pos: int, device_pos: bool) -> int:
        """The kernel launches of one decode token at position pos, its argmax included, recorded
        rather than run. A plan step may make more than one: attention past SPLIT_FROM tokens,
        the split launch and its combine. `device_pos`: the position as a compiled step passes
        it (an array: attention's grid is then sized for max_seq, not for pos)."""
        held, head = self.cache_arrays(), self._fused_head  # the recorded steps replace them with zeros
        try:
            with recording() as rec:
                logits = self.layers(mx.zeros((1,), mx.int32), 1, index(pos) if device_pos else pos)
                self.greedy(logits)
        finally:
            self.take_caches(held)
            self._fused_head = head
        return len(rec.jobs)

    def _concat(self, fused_name: str, parts: tuple[str, ...]) -> None:
        """Each layer's parts as the fused matrices of fused_runs (the plan asks it too): one
        where they share a block type; QKV in runs of one type where they do not (gate+up's SiLU
        epilogue needs both in one matrix). F16 parts (the unquantized baseline) join as fp16
        values, which MLX's matmul runs; a float part beside a quantized one is refused."""
        for i in range(self.config.n_layers):
            names = [f"blk.{i}.{p}.weight" for p in parts]
            kinds = {self.types[n] for n in names}
            floats = kinds & {"f16", "f32"}
            if (floats and len(kinds) != 1) or (len(kinds) != 1 and fused_name != "attn_qkv"):
                raise ValueError(f"the fused variant needs {parts} in one block type ({', '.join(QUANTIZED)}, "
                                 f"or F16), got {sorted(kinds)}")
            for name, run in fused_runs(self.types, i, fused_name, self.split_v):
                if len(run) == 1:
                    continue  # a part of a type of its own: its GGUF matrix
                self.w[name] = gemv.concat_rows([self.w.pop(n) for n in run])
                self.nk[name] = (sum(self.nk[n][0] for n in run), self.nk[run[0]][1])
                self.types[name] = self.types[run[0]]
                # Evaluated here, once: a lazy concatenation captured by mx.compile is part of the
                # traced step and was redone every token (64 weight copies per Llama-3-8B token,
                # seen in Nsight Compute). The parts are dropped: nothing reads them any more.
                mx.eval(self.w[name])

    @property
    def label(self) -> str:
        """The variant as results name it: the paged cache is marked (fused/paged)."""
        return f"{self.variant}/paged" if self.paged else self.variant

    def reset(self) -> None:
        c = self.config
        if self.paged:  # vLLM's layouts; NaN in every slot not yet written
            blocks, d = self.table.shape[1], c.head_dim
            k_shape, v_shape = (blocks, c.n_kv_heads, d // 8, BLOCK_SIZE, 8), (blocks, c.n_kv_heads, d, BLOCK_SIZE)
            self.k = [mx.full(k_shape, float("nan"), mx.float16) for _ in range(c.n_layers)]
            self.v = [mx.full(v_shape, float("nan"), mx.float16) for _ in range(c.n_layers)]
        elif self.stacked:
            shape = (c.n_layers, c.n_kv_heads, self.max_seq, c.head_dim)
            self.k, self.v = StackedCaches(mx.zeros(shape, mx.float16)), StackedCaches(mx.zeros(shape, mx.float16))
        else:
            shape = (c.n_kv_heads, self.max_seq, c.head_dim)
            self.k = [mx.zeros(shape, mx.float16) for _ in range(c.n_layers)]
            self.v = [mx.zeros(shape, mx.float16) for _ in range(c.n_layers)]
        self.pos = 0

    def cache_arrays(self) -> list[mx.array]:
        """The caches as a compiled step takes and returns them (generate(), the tools): every
        layer's K then every layer's V, or the two stacks (mega_kv_stacked)."""
        if self.stacked:
            return [self.k.whole(), self.v.whole()]
        return [*self.k, *self.v]

    def take_caches(self, arrays) -> None:
        """The caches from what a compiled step returned (cache_arrays' form)."""
        arrays = list(arrays)
        if self.stacked:
            self.k, self.v = StackedCaches(arrays[0]), StackedCaches(arrays[1])
        else:
            half = len(arrays) // 2
            self.k, self.v = arrays[:half], arrays[half:]

    def _slots(self, pos, t: int):
        """Paged slots (block * BLOCK_SIZE + offset) of positions pos .. pos+t-1: host ints, or
        int32[1] on the device for a compiled step's position array."""
        if isinstance(pos, int):
            p = np.arange(pos, pos + t)
            return self.table[0, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        return mx.take(self.table_dev[0], pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE

    # -- ops ------------------------------------------------------------------------------------------
    def matrix(self, name: str) -> mx.array | gemv.Packed:
        """A projection's weights as the GEMVs take them: repacked where the decoder repacked
        them, else the GGUF blocks (or fp16 values)."""
        return self.packed.get(name, self.w.get(name))

    def qmm_matrix(self, name: str, m: int) -> mx.array | gemv.Packed | gemv.RowBlocks:
        """The weights a launch of M rows reads: the RowBlocks copy (option qmm_rows8) where qmm
        takes those rows (5..QMM_UP_TO, prompt_qmm), else matrix(name)."""
        if name in self.rows8 and gemv.qmm_takes(m):
            return self.rows8[name]
        return self.matrix(name)

    def _linear(self, x: mx.array, name: str, residual: mx.array | None = None) -> mx.array:
        n, k = self.nk[name]
        if name in self.f16 and x.shape[0] > FUSED_UP_TO:  # a prompt's rows, on the copy made at load
            return gemv.matmul(x, self.f16[name], residual)
        if self.types[name] in QUANTIZED:
            return gemv.linear(x, self.qmm_matrix(name, x.shape[0]), self.types[name], n, k, residual=residual,
                               counters=self.qmm_sites.get(name))
        return gemv.matmul(x, self.w[name], residual)

    def forward(self, tokens, last_only: bool | None = None) -> mx.array:
        """Logits [len(tokens), vocab] (float32) for tokens at positions pos..; advances pos.
        `last_only` (default: the prompt_logits option): a prompt's last token's only ([1, vocab]),
        its head a GEMV over that row."""
        if isinstance(tokens, mx.array):
            ids = tokens.reshape(-1).astype(mx.int32)
        else:
            ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
        t = ids.size if isinstance(ids, mx.array) else len(ids)
        self._admit(t)
        if not isinstance(ids, mx.array):
            # Host tokens do not come out of the graph that wrote the cache, so nothing orders
            # this step's kernels after those in-place writes (kernels.rope.Rotated): finish
            # them first. Free when they are done (step mode); a device token (pipelined,
            # chained) is ordered by its data.
            mx.eval(self.cache_arrays(), *self._pending_head())
        logits = self.layers(ids, t, self.pos, last_only)
        self.pos += t
        return self._with_token(logits.astype(mx.float32), self._fused_head and self._fused_head[1])

    def _pending_head(self) -> list[mx.array]:
        """What a step from host tokens evaluates first beside the caches: the last fused head's
        token, whose scratch the next head launch reuses (nothing else orders two head launches
        whose outputs were never read), and the logits of a compiled call that returned no caches
        (nothing else runs its cache writes before this step's reads)."""
        return ([self._fused_head[1]] if self._fused_head else []) + self._unreturned

    def _with_token(self, logits: mx.array, token: mx.array | None) -> mx.array:
        """logits as returned, remembered with the token their head's launch gave (greedy())."""
        self._fused_head = None if token is None else (logits, token)
        return logits

    def _admit(self, t: int) -> None:
        """t tokens at self.pos fit the cache, and their kernels are compiled."""
        if t == 0:
            raise ValueError("tokens must not be empty")
        if self.pos + t > self.max_seq and (t > 1 or not self.overflow):
            raise ValueError(f"{self.pos + t} tokens do not fit the cache of {self.max_seq}: prompts must "
                             f"fit; decode steps wrap around only in a decoder made with overflow=True")
        if t not in self._prepared:
            self.prepare_kernels((t,), self.pos)

    def compiled_forward(self, tokens, last_only: bool | None = None) -> mx.array:
        """forward() through an mx.compile'd function of (ids, *k caches, *v caches), traced once
        per (length, position, last_only) and replayed after: the compiled modes' prompt. An eager prompt
        spends more host time building its graph (Python: the plan's steps, our launch
        wrappers, MLX's op calls: 7.5 ms for a Qwen3-0.6B 512-token prompt) than its kernels
        take (2.5-5 ms); a replay skips that Python (kernels/attention/NOTES.md)."""
        host, vocab = np.asarray(tokens).reshape(-1), self.config.vocab
        if host.size and (not np.issubdtype(host.dtype, np.integer) or host.min() < 0 or host.max() >= vocab):
            # checked here: ids on the device that fall outside the table give zero rows
            raise ValueError(f"token ids must be integers in 0..{vocab - 1}")
        ids = mx.array(host.astype(np.int32))
        t, pos = ids.size, self.pos
        last = t > 1 and last_row_only(last_only)
        self._admit(t)
        outputs = options.get("decode_cache_outputs")
        traced = self._compiled_prompts.get((t, pos, last, outputs))
        if traced is None:
            if len(self._compiled_prompts) >= 8:  # each holds its traced graph
                self._compiled_prompts.pop(next(iter(self._compiled_prompts)))
            # (the function, and whether it returns the head's token: asked once, not every prompt)
            traced = self._compiled_prompts[t, pos, last, outputs] = (
                mx.compile(self._over_caches(t, pos, last, outputs)), self.head_fused(t, last))
        fn, fused = traced
        mx.eval(self.cache_arrays(), *self._pending_head())  # host tokens: after pending writes (forward())
        logits, *caches = fn(ids, *self.cache_arrays())
        token = caches.pop(0) if fused else None
        if outputs:
            self.take_caches(caches)
        self._unreturned = [] if outputs else [logits]
        self.pos += t
        return self._with_token(logits.astype(mx.float32), token)

    def head_fused(self, t: int, last_only: bool = False) -> bool:
        """Whether the plan of t tokens (plan_for) gives the greedy token from its head's launch."""
        return any(step.op == "rmsnorm_linear_argmax" for step in self.plan_for(t, last_only))

    def _over_caches(self, t: int, pos: int | None = None, last_only: bool = False, cache_outputs: bool = True):
        """layers() as a function of its caches for mx.compile: (ids, [pos,] *caches) -> (logits,
        [token,] *caches), the caches (cache_arrays' form) inputs and outputs rather than state the
        trace would capture, the token where the head's launch gives it (head_fused). pos: fixed
        here (a prompt's), or None to take it as an argument (a decode step's int32[1]). Without
        `cache_outputs` the caches are inputs only: the kernels write them in place, and what reads
        them next is ordered after those writes by MLX's one stream once this call's logits are
        queued (a compiled step's token comes out of them; a host token evaluates them first)."""

        def over(ids, *rest):
            at, caches = (rest[0], rest[1:]) if pos is None else (pos, rest)
            held = self.k, self.v
            self.take_caches(caches)
            try:
                logits = self.layers(ids.reshape(-1), t, at, last_only)
                token = (self._fused_head[1],) if self._fused_head else ()
                return (logits, *token, *self.cache_arrays()) if cache_outputs else (logits, *token)
            finally:
                self.k, self.v = held

        return over

    def greedy(self, logits: mx.array) -> mx.array:
        """The next token id (int32[1], on the device): the token the head's launch gave with these
        logits (head_argmax), else our argmax kernel over their last row, read in the head's fp16 in
        a compiled step (no converted copy, no gather)."""
        if self._fused_head is not None and self._fused_head[0] is logits:
            return self._fused_head[1]
        return loop.argmax(logits[-1:])

    def compiled_step(self, ordered: bool = False):
        """One decode step as an mx.compile'd function of (token, pos, *caches) -> (logits,
        *caches), the caches in cache_arrays' form, traced once per decoder, the logits fp16 as the output
        head writes them (forward() returns them as float32): the position is an int32[1]
        array, so the RoPE + KV write and attention read it on the device, and attention's grid
        is sized for max_seq (kernels.attention.flash_decode). Host work per token is one call.
        By default the caches are evaluated before the call: a token from the host is not ordered
        after in-place writes still pending in a lazy graph (forward() does the same; on the
        H200 such a call read stale rows), and this is free when they are done. `ordered=True`
        gives the bare step for a caller whose token comes out of the graph that wrote the
        caches (the previous step's argmax), so that steps can be queued ahead (pipelined)."""
        outputs = options.get("decode_cache_outputs")
        if outputs not in self._compiled:
            self._compiled[outputs] = mx.compile(self._over_caches(1, cache_outputs=outputs))
        compiled, fused = self._compiled[outputs], self.head_fused(1)

        def run(token, pos, *caches):
            if not ordered:
                mx.eval(caches, *self._pending_head())
            logits, *rest = compiled(token, pos, *caches)
            logits = self._with_token(logits, rest.pop(0) if fused else None)
            self._unreturned = [] if outputs else [logits]
            # the caches as passed where the step returns none: callers take them back either way
            return (logits, *(rest if outputs else caches))

        return run

    def plan_for(self, t: int, last_only: bool | None = None) -> list[Step]:
        """The plan that t tokens replay (kernel_plan of their phase; `last_only`: last_row_only's,
        for a prompt: a decode token's head is its one row), built once per phase and head."""
        key = "rows" if 1 < t <= self.prompt_rows else phase_of(t), t > 1 and last_row_only(last_only)
        if key not in self._plans:
            self._plans[key] = kernel_plan(self.config, self.fused, self.paged, self.overflow, self.seams,
                                           self.rope_attention, self.types, key[0], bool(self.packed), self.mega,
                                           span=self.span, f16_copies=bool(self.f16), last_only=key[1])
        return self._plans[key]

    def layers(self, ids, t: int, pos, last_only: bool | None = None) -> mx.array:
        """The model over t tokens at positions pos.. (an int; an int32[1] array in a compiled
        step) by replaying the plan of their phase, K and V written into self.k / self.v in
        place; the logits as the head wrote them (fp16, or float32 from an F32 output matrix),
        the last row's only where `last_only` (plan_for)."""
        env = replay(self.plan_for(t, last_only), self, {"token": ids}, t, pos)
        return self._with_token(env["logits"], env.get("next_token"))
