"""Experiment options: the switches that change what the kernels and the decode loop do, declared
once (name, default, type, help) and recorded in every results row that differs from the defaults.

They are process-wide and meant to be set before the first launch: `lathe decode --set
seams=off,attn_partition=128`, `lathe bench --set ...`, or in the environment, which is read
here and nowhere else, as `LATHE_SET="seams=off,attn_partition=128"` or one variable an option
(`LATHE_SEAMS=0`, the option's name upper-cased). Code reads an option when it needs it
(`options.get("seams")`), never into a constant at import, so that a test or a profile can
change it (`with options.use(seams=False): ...`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"expected on/off (or 1/0, true/false, yes/no), got {text!r}")


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _staged_buffers(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    value = _count(text)
    if value not in (0, 2, 3, 4):
        raise ValueError(f"expected auto, 0 (off) or 2..4 buffers, got {text!r}")
    return value


def _auto_or_count(text: str) -> int | None:
    return None if text.strip().lower() in ("auto", "") else _count(text)


def _auto_or_flag(text: str) -> bool | str:
    return "auto" if text.strip().lower() == "auto" else _flag(text)


def _auto_or_flag_none(text: str) -> bool | None:
    return None if text.strip().lower() in ("auto", "") else _flag(text)


def _gemv_kinds(text: str) -> str:
    """A '+'-joined set of the blocks' GEMV phase kinds (qkv, o, up, down), or none ("")."""
    kinds = [k for k in text.strip().lower().split("+") if k]
    bad = [k for k in kinds if k not in ("qkv", "o", "up", "down")]
    if bad:
        raise ValueError(f"expected GEMV kinds of qkv, o, up, down joined by '+', got {text!r}")
    return "+".join(sorted(set(kinds), key=("qkv", "o", "up", "down").index))


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return value

    return parse


def _tuning(text: str) -> str:
    # The form only: kernels.gemv checks the keys when the option is applied (its hook). Pairs
    # are joined by '+' ('--set' splits options at commas; LATHE_GEMV_TUNING may use either).
    pairs = [p.strip() for p in re.split(r"[,+]", text) if p.strip()]
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not (key.strip().isidentifier() and eq and value.strip().isdigit()):
            raise ValueError(f"expected KEY=INT pairs joined by '+', got {text!r}")
    return "+".join(pairs)


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str

    @property
    def env(self) -> str:
        return "LATHE_" + self.name.upper()

    def show(self, value: Any) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        return "auto" if value is None else str(value) or "none"


DECLARED = (
    Option("seams", False, _flag,
           "fused loop: each output projection and the next RMSNorm+GEMV in one launch (kernels.gemv.seam)"),
    Option("repack", True, _flag,
           "decode loop: Q4_0/Q8_0 matrices repacked at load for the v3 GEMVs and seams (kernels.gemv.repack)"),
    Option("swiglu_at", "gate_up", _one_of("gate_up", "down"),
           "fused loop, repacked weights, no seams: silu(gate) * up in the gate+up GEMV's epilogue "
           "(gate_up) or in the down GEMV's staging (down; kernels/gemv/NOTES.md)"),
    Option("mixed_projection", "pair", _one_of("pair", "concat"),
           "fused loop, repacked weights: a fused projection whose parts differ in block type (Q4_K_M's "
           "Q6_K attn_v in some layers) as one GEMV launch over both matrices (pair: kernels.gemv's w_b), "
           "or a GEMV a type and mx.concatenate (concat)"),
    Option("rope_in_attention", True, _flag,
           "fused loop (no head norms): a decode token's RoPE + KV write inside the attention launch"),
    Option("rope_in_prefill", False, _flag,
           "fused loop, a prompt of up to 128 tokens on the contiguous cache: its RoPE (and head norms) and KV "
           "write inside wgmma's prefill attention launch (kernels.attention.rope_prefill_attention; where "
           "wgmma cannot take it, the two launches as before). Off by default: a launch a layer fewer did not "
           "move pp16 or pp64, and the launch costs more GPU time than the two (kernels/loop/NOTES.md)"),
    Option("attn_partition", None, _auto_or_count,
           "split attention's tokens a threadgroup (auto: sized for about 512 threadgroups)"),
    Option("attn_split_grid", None, _auto_or_count,
           "split attention: threadgroups the automatic partition length aims at (auto: 256 for the MMA "
           "form, 512 otherwise; in a token block bound to N threadgroups an SM, N times the SMs)"),
    Option("attn_v_prefetch", None, _auto_or_count,
           "decode attention: 8-token V vectors a SIMD group loads at a time, 1, 2 or 4 (auto: all 4 of a "
           "chunk, with its K loads, where D <= 128 and the grid is under 512 threadgroups; 256 / D in "
           "larger grids, whose threadgroups then take fewer registers and fit 4 an SM: "
           "kernels/attention/NOTES.md)"),
    Option("attn_k_slots", None, _auto_or_count,
           "decode attention: K rows through threadgroup memory, a round of 8 vectors a thread copied at once "
           "(cp.async), in this many slots: 0 (loaded into registers), 1, or 2 (the next round's copies during "
           "this one's products); auto: 2 where the backend's threadgroup memory allows (kernels/attention/NOTES.md)"),
    Option("attn_mma", "auto", _one_of("auto", "on", "off"),
           "decode attention: scores and P.V on SIMD-group matrices (tensor cores on CUDA), a SIMD group its "
           "own 32 tokens of a chunk; auto: from 4 query heads a threadgroup (Llama-3's), on: wherever the "
           "form allows (K slots, <= 8 heads, D 32..128), off: FMAs a thread a token (kernels/attention/NOTES.md)"),
    Option("attn_k_copy", "auto", _one_of("auto", "token", "row"),
           "decode attention, MMA form, contiguous cache: K's copies a thread a token's vectors (token), or "
           "a SIMD group's 32 tokens by whole rows, 8 lanes a row (row: full sectors an instruction, "
           "more registers); auto: row in grids of at most 256 threadgroups (kernels/attention/NOTES.md)"),
    Option("attn_merge_split", True, _flag,
           "split attention's in-launch merge: where a threadgroup's output slots take at most half its threads "
           "and there are 32 partitions or more, the idle half adds the second half of the partitions (half "
           "the rounds of loads; kernels/attention/NOTES.md); off: every slot's partitions in one run"),
    Option("attn_combine", "auto", _one_of("auto", "launch", "last_group"),
           "split attention's partitions merged by a combine launch of their own (launch), or by the "
           "last threadgroup of each head group in the same launch (last_group: one launch fewer); auto: "
           "last_group, except in the fused decode loop's RoPE + attention launch, where it measured "
           "1.25 us a layer slower at depth 4096 (kernels/attention/NOTES.md)"),
    Option("attn_prefill", "auto", _one_of("auto", "wgmma", "tiled", "decode"),
           "a prompt's attention: query tiles against K/V tiles on SIMD-group matrices (tiled), the same "
           "on Hopper's warpgroup MMA (wgmma: a native CUDA kernel, sm_90a, D 64 or 128), wgmma where it "
           "runs and tiled elsewhere (auto), or the decode kernel with one query per token (decode; "
           "kernels/attention/NOTES.md)"),
    Option("prompt_logits", "all", _one_of("all", "last"),
           "kernel variants: forward()'s logits for a prompt's every token (all), or for the last one "
           "only (last: the head as a GEMV over one row). generate() and the decode matrix ask for the "
           "last row either way, as llama-bench's pp computes (kernels/loop/NOTES.md)"),
    Option("head_argmax", True, _flag,
           "kernel variants on repacked weights: where the output head is one row's RMSNorm+GEMV (a decode "
           "token's, a prompt's last row), its launch also gives the greedy token (the argmax over the "
           "logits it writes), with no argmax launch after it (off: the head, then kernels.loop.argmax)"),
    Option("prompt_weights", "dequantize", _one_of("dequantize", "f16"),
           "kernel variants: a prompt's matmuls take each quantized matrix dequantized to fp16 by a launch "
           "per prompt (dequantize), or an fp16 copy made once when the decoder is built (f16: no "
           "dequantize launches, at twice the weights' memory; kernels/attention/NOTES.md)"),
    Option("prompt_qmm", True, _flag,
           "linear() for 5..64 rows of X on repacked weights (a short prompt's projections): the quantized "
           "GEMM (kernels.gemv.qmm: W read once, on SIMD-group matrices); off: GEMV launches of 4 rows "
           "below 16 rows, dequantize + MLX's matmul from there (kernels/gemv/NOTES.md)"),
    Option("qmm_rows8", False, _flag,
           "the decoder keeps a second copy of each Q4_0 and Q8_0 matrix as RowBlocks (kernels.gemv."
           "interleave_rows: a row block's 8 rows interleaved a super-chunk at a time, twice the weights' "
           "memory), and qmm's launches (5..64 rows: serve's batched steps, short prompts) read it, qmm_mma's "
           "too where qmm hands them on; the GEMVs keep the v3 copy (kernels/gemv/NOTES.md, \"RowBlocks\")"),
    Option("qmm_prologue", "auto", _auto_or_flag,
           "prompt_qmm's plan: on, RMSNorm as qmm's prologue (QKV, gate+up; each threadgroup works out every "
           "row's 1 / rms over all of K, reading all of X); off: lathe's rmsnorm launch first, then qmm on its "
           "output (the gated epilogue kept); auto: on where d_model < 4096, off from there. The 8B's serve at "
           "32 and 64 sequences took 1.3-1.4x the tok/s off (GPU-bound: the prologue's reads of X); Qwen3's "
           "fused serve at 8 and 32, host-bound, took 7-58% more on (one launch fewer a norm; kernels/loop/"
           "NOTES.md, 3bd2061)"),
    Option("qmm_mma", "auto", _auto_or_flag,
           "qmm's launches of Q4_0 and Q8_0 matrices without its RMSNorm prologue (the 8B's serve steps and short "
           "prompts, Qwen3's O and down) go to kernels.gemv.qmm_mma, the native GEMM on the warp MMA, where native "
           "kernels run (sm_90); its parts, residual, SiLU epilogue and next_norm through qmm's adding launches. "
           "auto: on matrices of 2^24 weights and more (the 8B's; Qwen3's fused serve at 8 sequences lost 35% with "
           "it, host-bound: a launch more a split matrix). On an H200 at babd185 the 8B's fused serve at 32 and 64 "
           "sequences took 1.15-1.27x the decode tok/s with it (kernels/gemv/NOTES.md)"),
    Option("qmm_norm_after", True, _flag,
           "prompt_qmm's plan with qmm_prologue off: each RMSNorm that follows O's or down's qmm + residual is "
           "written by the launch that adds qmm's parts (qmm's next_norm: a threadgroup a row; the rmsnorm "
           "launch's bits up to 1024 values a row, within an fp16 step past it), not by an rmsnorm launch of its "
           "own; the output norm stays a launch. The 8B's fused serve at 8 sequences: 1.58-1.61x llama-batched-"
           "bench on, 1.36-1.53x off (2c939ad, kernels/loop/NOTES.md)"),
    Option("qmm_fill", 512, _count,
           "qmm (5..64 rows), K from 4096: split K over threadgroups (at most 8 parts, a second launch adding "
           "them) until a launch has this many threadgroups, half as many past 32 rows (0: never split; the "
           "sweep of a397c5c, kernels/gemv/NOTES.md)"),
    Option("qmm_combine", "auto", _one_of("auto", "launch", "last_group"),
           "qmm with K split where the caller gives its site's counters (the decode plan's projections): the "
           "parts added by a second launch (launch), or by the last of a row block's threadgroups in the same "
           "launch (last_group: a launch fewer a split matrix, Qwen3-0.6B's O and down; next_norm's rows keep "
           "their adding launch); auto: last_group up to 16 rows, where serve's steps of 8 sequences gained "
           "(the 8B 5%, Qwen3's host-bound step more), launch past it, where a row block's adds in one "
           "threadgroup cost the 8B's steps of 64 8% (kernels/gemv/NOTES.md)"),
    Option("qmm_x_staged", "auto", _staged_buffers,
           "qmm (5..64 rows): X staged in threadgroup memory for all the threadgroup's SIMD groups, which then "
           "read it from there rather than each from L1 (qmm's knob xs): auto, in 2 buffers from 33 rows on "
           "matrices of 4096 x 14336 weights and more (the 8B's gate+up, down, head), and for Q4_0 and Q8_0 on "
           "every K from 4096 past 32 rows (W a super-chunk ahead, pf) and from 17 rows on the largest (W "
           "through a ring, wr); 0: never; 2..4: on every shape, in that many buffers, without pf or wr "
           "(qmm_by_shape; kernels/gemv/NOTES.md)"),
    Option("paged_qkv_rows", True, _flag,
           "the paged RoPE + K/V write (serve's batched steps, the paged decode loop) reads Q, K and V from the "
           "fused QKV projection's rows (rope_paged_qkv_write); off: from MLX slices of it, which MLX copies "
           "before the launch where they hold more than one row (3 launches a layer; kernels/loop/NOTES.md)"),
    Option("serve_rope_attention", True, _flag,
           "lathe serve, a step of decode tokens only on fused's plan: each layer's RoPE, K/V write and paged "
           "attention in one launch (kernels.attention.paged_rope_attention); off: rope_paged_qkv_write, "
           "then paged_attention (kernels/loop/NOTES.md)"),
    Option("serve_split_from", 2048, _count,
           "lathe serve, fused's plan: a decode step's attention splits the table's tokens into partitions "
           "(flash decode) where the table holds more than this many, as the decode loop's does past 2048; "
           "0 splits serve's short contexts too (129-256 tokens: a kv head's whole context a threadgroup, "
           "6% occupancy at 8 sequences; kernels/attention/NOTES.md)"),
    Option("prompt_compiled", True, _flag,
           "kernel variants, compiled modes: a prompt through an mx.compile'd forward traced once per "
           "(length, position), as the decode step is (off: the eager forward; kernels/attention/NOTES.md)"),
    Option("serve_compiled", True, _flag,
           "lathe serve, kernel variants: a step of decode tokens only through an mx.compile'd forward traced "
           "once per (batch, table width rounded up to a power of two), as the decode loop's compiled step "
           "(off: every step built eagerly; harness/program/batch_forward.py)"),
    Option("serve_pipelined", True, _flag,
           "lathe serve: a step's tokens stay on the device and the next step is queued before they are read "
           "(one step in flight, as the decode loop's compiled-pipelined mode; a decode-only step takes its ids "
           "from the last step's argmax); off: every step's tokens read before the next is built "
           "(harness/program/batch_forward.py)"),
    Option("decode_cache_outputs", True, _flag,
           "kernel variants, compiled modes: the compiled decode step and prompt return the caches (every layer's "
           "K and V, or megafused's two stacks: the arrays that order the next reads after their in-place writes) "
           "besides the logits; off: the logits (and head token) only, the writes ordered by MLX's one stream and "
           "the step's token, or by evaluating the last call's logits before a host token's step; level with on "
           "for Qwen3-0.6B's prompt and token on an H200, so on (harness/program/kernel_decode.py, "
           "kernels/loop/NOTES.md; serve_cache_outputs is lathe serve's)"),
    Option("serve_cache_outputs", False, _flag,
           "lathe serve, kernel variants: the compiled decode step returns the pools' K and V (the arrays that "
           "order a layer's next reads after its in-place writes) besides the logits; off: the logits only, the "
           "pools staying the arrays they were (the writes are ordered by the stream and the step's tokens), "
           "which leaves MLX one node a layer fewer to replay and evaluate (harness/program/batch_forward.py)"),
    Option("serve_token_words", True, _flag,
           "lathe serve, kernel variants: a step's tokens read by the host from argmax's 8-byte outputs (MLX's "
           "small pool of managed memory, which the GPU maps), and a decode step's host-made arrays as views "
           "of one, so that no kernel output lands in a buffer whose page the host last touched (on an H200 "
           "the argmax then took 41-47 us a call at the median, up to 580, against 7; kernels/loop/NOTES.md)"),
    Option("serve_device_inputs", True, _flag,
           "lathe serve, kernel variants: a decode step whose sequences each moved on one token over the "
           "same block tables makes its positions, slots and lengths on the device from the last step's "
           "(one small compiled launch), so that the step writes no host memory (managed pages the host "
           "wrote each step cost serve's Qwen3-0.6B token_block of 8 sequences 1400-1700 us launch by launch, "
           "with a period of about four steps; on: 1405-1425, 6% less at the mean, decode 7-17% faster on an "
           "H200: kernels/loop/NOTES.md; harness/program/batch_forward.py)"),
    Option("serve_mega_up_to", 8, _count,
           "lathe serve, megafused variant: a decode-only step of up to this many sequences runs token_block "
           "launches of serve_mega_rows sequences each (every weight read once a launch); a larger one fused's plan, whose "
           "GEMMs read the weights once for the whole batch (harness/program/batch_forward.py)"),
    Option("serve_mega_rows", 8, _count,
           "lathe serve, megafused variant: the sequences a token_block launch of a decode-only step takes "
           "(1..8, kernels.blocks.BATCH_ROWS; its GEMV phases run that many rows over one read of the weights); "
           "more go in launches of as many (8: Qwen3-0.6B's steps of 6 and 8 sequences 26-38% faster than "
           "at 4 on an H200; harness/program/batch_forward.py)"),
    Option("serve_mega_extra", 8000, _count,
           "lathe serve, megafused variant: millions of weight products a decode-only step of t sequences may "
           "add to one sequence's in token_block's batch form, (t - 1) x the layers' weights; a step past it runs "
           "fused's plan. The batch form multiplies each weight once a sequence on the CUDA cores, fused's GEMMs "
           "on tensor cores: on an H200 Qwen3-0.6B's 8 sequences (3083) and Llama-3-8B's 2 (6979) were faster in "
           "the batch form, the 8B's 4 (20937) and 8 slower (harness/program/batch_forward.py)"),
    Option("serve_mega_together", False, _flag,
           "lathe serve, megafused variant: a step's token_block launches (of serve_mega_rows each) take the pool "
           "as the step found it and 1 / launches of the GPU's threadgroups each, so that they run at once "
           "(off: one after another, each over the whole GPU; measured slower at 6 and 8 sequences, so off: "
           "kernels/loop/NOTES.md)"),
    Option("attn_query_split", None, _auto_or_count,
           "split a kv head's query heads over threadgroups while the grid stays within this many (0: never); "
           "auto: 64, and in a token block bound to N threadgroups an SM, N times the SMs for the tickets of "
           "every partition but the last (kernels/loop/NOTES.md)"),
    Option("pad_constants", True, _flag,
           "kernel constants in buffers of their own, not MLX's small managed pool (kernels/loop/NOTES.md)"),
    Option("native_image", "auto", _one_of("auto", "fatbin", "cubin"),
           "what a native CUDA kernel (kernels/native.py) hands MLX: its cubin, or a compressed fatbin of it "
           "(nvFatbin; a third of the bytes, which MLX hashes at every launch); auto: the fatbin where "
           "libnvfatbin is found"),
    Option("inline_source", False, _flag,
           "CUDA: hand MLX each kernel's text instead of an #include line of it (kernels/runtime.py)"),
    Option("mega_span", "token", _one_of("token", "layer"),
           "megafused decode: a whole token's layers in one launch (token: kernels.blocks.token_block) "
           "or one launch a layer (layer: layer_block)"),
    Option("mega_prompt_rows", 0, _count,
           "megafused (mega_span=token, CUDA): a prompt of up to this many tokens runs token_block's prompt form, "
           "its rows 8 a launch, every layer in each, rather than fused's few launches a layer (0: never). Off: "
           "on an H200 Qwen3-0.6B's 16 tokens were level with fused's plan (two launches of 1.4 ms of GPU time "
           "against 173 launches of MLX host time) and Llama-3-8B's 4x slower, the phases' GEMVs at 8 rows "
           "(kernels/loop/NOTES.md)"),
    Option("mega_kv_stacked", True, _flag,
           "megafused decode (mega_span=token): every layer's K cache in one array and every layer's V in "
           "another, so the compiled step takes and returns 2 caches, not 2 x layers (the host's time a "
           "token: kernels/loop/NOTES.md)"),
    Option("block_signal_apart", True, _flag,
           "the blocks' threadgroups signal a ticket done from another thread than the one that claims the "
           "next, so the signal's wait for the ticket's writes overlaps the claim (Qwen3-0.6B's token 1.3-1.9% "
           "shorter; kernels/loop/NOTES.md)"),
    Option("block_prefetch", True, _flag,
           "the blocks' GEMV phases issue their first weights before waiting on the phase before"),
    Option("block_prefetch_skip", "", _gemv_kinds,
           "with block_prefetch: these GEMV phases of the blocks ('+'-joined: qkv, o, up, down) wait before "
           "issuing their first weights, so that their loads do not queue ahead of the phase before's "
           "(kernels/loop/NOTES.md)"),
    Option("block_l2_ahead", False, _flag,
           "with block_prefetch: the blocks' GEMV phases also ask the L2 cache for the rest of their rows "
           "before the wait (prefetch.global.L2; nothing on Metal)"),
    Option("gemv_x_items", 1, _count,
           "the v3 GEMVs (the fused loop's, 1-4 rows) stage X' (gemv/x_stage.metal) this many items (16 values of "
           "a row) a thread a pass, every item's loads out before the first is used (block_x_items' twin; "
           "kernels/loop/NOTES.md)"),
    Option("block_x_items", None, _auto_or_count,
           "the blocks' GEMV phases stage X' (gemv/x_stage.metal) this many items (16 values of a row) a thread a "
           "pass, every item's loads out before the first is used (one a pass waited an L2 round trip a pass: 8 "
           "for the batch form's 8 rows of K = 2048); auto: 2 past 4 rows (NVRTC sm_90: the 8-row paged token "
           "block 156 registers against 152, 3 threadgroups an SM either way), 1 otherwise (2 took Qwen3's "
           "token block from 4 threadgroups an SM to 3; kernels/loop/NOTES.md)"),
    Option("block_attn_ahead", True, _flag,
           "the blocks' attention phase asks the L2 cache for its head's cached K and V rows (the tokens "
           "before this one's) before it waits on the QKV phase (prefetch.global.L2; an unsplit context, "
           "contiguous or the batch form's paged pool; nothing on Metal; kernels/loop/NOTES.md)"),
    Option("block_o_codes", "auto", _auto_or_flag,
           "the blocks' launches over an unsplit context: each attention ticket writes its output as the O "
           "phase's X' (int16 codes, a scale and a sum a block of 32), which the O tickets copy, where each "
           "quantized all M rows of the attention's output (auto: the batch and prompt forms, M > 1; on: a "
           "single token too; kernels/loop/NOTES.md)"),
    Option("block_rms_late", True, _flag,
           "the blocks' QKV and UP phases (X' in one chunk) stage x * norm with no pass over x first: each row's "
           "sum of squares comes from the staging's own loads and the GEMV scales its sums by the row's 1 / RMS "
           "(gemv/x_stage.metal; on an H200 Qwen3-0.6B's token 2-4% faster, the 8B's level, serve's compiled step "
           "of 8 sequences 4-7% faster; kernels/loop/NOTES.md)"),
    Option("block_act_codes", False, _flag,
           "the blocks' launches (one token or M): the UP phase also quantizes act as the DOWN phase's X', "
           "each block of 32 columns by the last SIMD group to write it (a count a block, a release and an "
           "acquire on the UP phase's path), which the DOWN tickets copy, where each quantized all M rows "
           "(kernels/loop/NOTES.md)"),
    Option("block_narrow", 256, _count,
           "the blocks' GEMV phases (not gate|up) with fewer tickets than this halve their rows a SIMD group "
           "until they have that many or take one row (0: never; kernels/loop/NOTES.md)"),
    Option("block_split_from", 512, _count,
           "token_block's attention phase splits contexts longer than this (and than one partition) over "
           "tickets, merged in the launch (512: Qwen3's token at 1024 tokens in half the time of the "
           "unsplit walk; at 128 the split lost 1.6%: kernels/loop/NOTES.md)"),
    Option("block_balance", False, _flag,
           "the blocks' GEMV phases (not gate|up) whose tickets stream row groups halve their rows a SIMD "
           "group while that lowers the most rows any SIMD group takes (kernels/loop/NOTES.md)"),
    Option("block_two_passes", True, _flag,
           "the blocks' single-token launch over an unsplit context (not the K-quants): a GEMV phase whose "
           "lanes would take 4 or more passes over a row issues the loads of two at once where that is at most "
           "7 (the 8B Q4_0's down, 14 loads a lane: P 4 -> 7; kernels/loop/NOTES.md)"),
    Option("block_phases", "", _tuning,
           "the blocks' GEMV phases set by hand, KIND_X=INT pairs joined by '+' (KIND: qkv, v, o, up, down; X: "
           "r rows a SIMD group, p loads in flight, t tickets at most): e.g. down_r=4 or down_t=256, so that a "
           "ticket's staged X' serves more rows (applied after block_narrow and block_balance; "
           "kernels/loop/NOTES.md)"),
    Option("block_k_slots", None, _auto_or_count,
           "the blocks' attention phase: K rows through threadgroup memory in at most this many slots (fewer "
           "where the launch's threadgroup memory cannot hold them: none in Llama-3-8B's token block), as "
           "decode attention's attn_k_slots (0: loaded into registers; 1; 2: the next round's copies during "
           "this one's products); auto: 1, with the MMA form where the launch splits the context "
           "(block_split_from), without it where it does not (kernels/loop/NOTES.md)"),
    Option("block_k_early", None, _auto_or_flag_none,
           "with block_k_slots: the attention ticket that writes its query's new K row copies its first rounds "
           "of K from the cache (one a slot) before it waits on the QKV phase, the new row left out and filled "
           "into its slot from threadgroup memory once rotated, where it copied them after the query was ready; "
           "auto (with block_k_slots auto): on with two slots and without the MMA form for a decode token's "
           "attention with head norms and heads of up to 128 values, where two slots fit (Qwen3-0.6B on an H200: "
           "1.7-3% faster at depth 0 and 4096; one slot early lost 4% at depth 0), else off (kernels/loop/NOTES.md)"),
    Option("block_timeline_marks", False, _flag,
           "harness.tools.block_timeline: stamp three marks inside each attention ticket (its query ready, "
           "first scores, last P.V) beside a ticket's three; they lie on the attention phase's path and cost "
           "Qwen3-0.6B's stamped token about 7% at depth 0 on an H200 (kernels/loop/NOTES.md)"),
    Option("block_v_straight", True, _flag,
           "the blocks' paged attention phase (token_block's batch form, lathe serve --variant megafused) loads a "
           "chunk's V vectors as one straight run, those past the chunk from its first vector (unused); off: "
           "each behind a branch, which took the paged token_block to 181 registers against 128 (NVRTC sm_90, "
           "Qwen3-0.6B: 2 threadgroups an SM against 4)"),
    Option("block_k_in_x", False, _flag,
           "the blocks' attention phase: where block_k_slots' slots do not fit beside the GEMV phases' "
           "staged X' (Llama-3-8B's token block), as many as X' holds go in X' itself, which an attention "
           "ticket does not read; correct, but the 8B's megafused decode lost 14% at depth 0 and 3% at "
           "4096 on an H200 (kernels/loop/NOTES.md)"),
    Option("block_min_groups", None, _auto_or_count,
           "the blocks' launches on CUDA: compiled for at least this many threadgroups an SM "
           "(__launch_bounds__), the compiler holding its registers to what they leave and spilling past "
           "that; 0: the compiler's choice. The token block's occupancy sizes its tickets (block_grid "
           "resident), so this sets how many run at once. auto: 4 for token blocks of 4 SIMD groups without "
           "head norms, post norms, the attention's MMA form or the paged batch form, heads up to 128 "
           "(Llama-3-8B on an H200: +2.3% at depth 0, +9.5% at 4096 tokens, Q8_0 +12.5%; Qwen3-0.6B's "
           "split module spilled and lost 8%; kernels/loop/NOTES.md); the batch form's wide tickets "
           "(block_batch_simds): 128 registers, 2 threadgroups of 8 SIMD groups; else 0"),
    Option("block_batch_simds", None, _auto_or_count,
           "token_block's batch form (a token of each of M > 1 sequences over the paged pool): SIMD groups a "
           "threadgroup, each ticket's rows then twice as many for the same staged X' (all M rows of it, which "
           "every ticket quantizes), its registers held to 128 (block_min_groups auto: 2 threadgroups of 8 an "
           "SM); 4 or 8, 0: the shared geometry's. auto: 8 past 4 sequences whose context does not split "
           "(Qwen3-0.6B's step of 8 on an H200: 12-15% less GPU time; level at 4, slower at 2; "
           "kernels/loop/NOTES.md), else 0. Set to 4 or 8, it also sets a single token's launch (auto leaves "
           "that at the shared geometry's)"),
    Option("block_attn_mma", True, _flag,
           "with block_k_slots: the blocks' attention phase scores and takes P.V on SIMD-group matrices "
           "where the form allows (<= 8 heads a threadgroup, D a multiple of 32 up to 32 NSIMD), as attn_mma"),
    Option("block_geometry", "shared", _one_of("shared", "per_gemv"),
           "the blocks' GEMV phases: all the first GEMV's rows a SIMD group and loads in flight (shared), "
           "or each its own (per_gemv: slower so far, more registers for the whole launch; kernels/loop/NOTES.md)"),
    Option("block_xchunk", 0, _count,
           "the blocks' launches stage X' in chunks of at most this many values (a multiple of 2048; 0: all of "
           "the longest K where it fits beside the launch's other arrays): the 8B token's down phase, which "
           "stages all 14336 values before most of its weights are asked for, would then issue each chunk's "
           "weights before staging it; measured slower: the 8B's megafused decode 512 against 523-537 tok/s "
           "at depth 0, 346 against 383-384 at 4096, the down phase serialized on each chunk's staging "
           "(H200, kernels/loop/NOTES.md)"),
    Option("gemv_row_passes", "row", _one_of("launch", "row"),
           "v3 GEMVs that share a launch's X' staging (the fused variant's seams, the blocks' phases): a lane's "
           "passes over a row run to the row's own chunks (row: the 8B Q4_0 megafused token 12% shorter, its "
           "Q4_K_M 26%, though NVRTC gives the first 155 registers against 124), or to the launch's X' chunk, "
           "sized by its longest K (launch: the 8B token's K = 4096 phases ran 3 passes of dead loads after "
           "their one; kernels/loop/NOTES.md)"),
    Option("block_grid", "resident", _one_of("resident", "shape"),
           "the blocks' claimed GEMV phases: at most the threadgroups the GPU holds of the launch at once, "
           "from its module's occupancy (resident), or the standalone GEMV's grid cap (shape; kernels/loop/NOTES.md)"),
    Option("gemv_tuning", "", _tuning,
           "GEMV launch knobs, KEY=INT pairs of kernels.gemv.TUNING joined by '+' (e.g. R=4+NSIMD=4)"),
)
OPTIONS = {o.name: o for o in DECLARED}
_values: dict[str, Any] = {o.name: o.default for o in DECLARED}
_hooks: dict[str, Callable[[Any], None]] = {}


def get(name: str) -> Any:
    return _values[_known(name)]


def _known(name: str) -> str:
    if name not in OPTIONS:
        raise ValueError(f"unknown option {name!r}; the options are: {', '.join(OPTIONS)}")
    return name


def parse(text: str) -> dict[str, Any]:
    """'name=value,name=value' -> {name: value}, each checked against its declaration."""
    found: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not eq:
            raise ValueError(f"an option is name=value, got {item!r}")
        option = OPTIONS[_known(name)]
        if name in found:  # one run, one value: an A/B is two runs (or a sweep), not a list
            raise ValueError(f"option {name} is given twice ({text!r}); A/B runs take one value each")
        try:
            found[name] = option.parse(value.strip())
        except ValueError as exc:
            raise ValueError(f"option {name}: {exc}") from None
    return found


def set_options(changes: dict[str, Any]) -> None:
    """Set options (already parsed values); an option with a hook (gemv_tuning) applies itself."""
    for name, value in changes.items():
        if _known(name) in _hooks:
            _hooks[name](value)  # first: a value its hook refuses is not kept
        _values[name] = value


def on_change(name: str, hook: Callable[[Any], None]) -> None:
    """Call `hook(value)` whenever the option is set (and now, if it differs from its default)."""
    _hooks[_known(name)] = hook
    if _values[name] != OPTIONS[name].default:
        hook(_values[name])


@contextlib.contextmanager
def use(**changes: Any) -> Iterator[None]:
    """Options changed inside the block only (tests, A/B runs in one process): every option is
    back to its value before the block afterwards, whatever the block set."""
    held = dict(_values)
    set_options(changes)
    try:
        yield
    finally:
        set_options({n: v for n, v in held.items() if _values[n] != v})


def changed() -> dict[str, Any]:
    return {n: v for n, v in _values.items() if v != OPTIONS[n].default}


def describe(values: dict[str, Any] | None = None) -> str:
    """'name=value,...' of the options that differ from their defaults ('' when none): the
    `options` column of results rows."""
    values = changed() if values is None else values
    return ",".join(f"{n}={OPTIONS[n].show(v)}" for n, v in values.items())


def describe_under(changes: dict[str, Any]) -> str:
    """describe() of the options in force with `changes` made (an --ab arm's `options` column)."""
    with use(**changes):
        return describe()


def table() -> str:
    """Every option: its value now, its default and what it does (`lathe options`)."""
    width = max(len(n) for n in OPTIONS)
    return "\n".join(f"{o.name:<{width}}  {o.show(_values[o.name]):>5} (default {o.show(o.default)})  {o.help}"
                     for o in DECLARED)


def _from_environment(env: os._Environ | dict) -> dict[str, Any]:
    found = parse(env.get("LATHE_SET", ""))
    for o in DECLARED:
        if env.get(o.env):
            try:
                found[o.name] = o.parse(env[o.env])
            except ValueError as exc:
                raise ValueError(f"{o.env}: {exc}") from None
    return found


set_options(_from_environment(os.environ))
