"""Decode as llama-bench measures it: run_decode() times generate() over variants, modes, depths
and repeats (a prompt, then n tokens), with the weights + KV roofline of each row and the split of
a token's time between building its graph and waiting for it (breakdown). The loop itself, its
variants and modes are harness/program/decode.py and harness/program/kernel_decode.py."""

from __future__ import annotations

import dataclasses
import gc
import sys
import time

import mlx.core as mx
import numpy as np

from harness.program.decode import (KV_LAYOUTS, MODES, VARIANTS, _backend, generate, make_decoder, model_file,
                            prompt_forward)
from harness.program.models import Model, file_type_name, load_gguf, tensor_shapes
from kernels import options


def traffic(model: Model, position: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode token must read at cache position `position`: every
    matrix as stored in the GGUF (quantized blocks as blocks), one embedding row, the output
    matrix (the embedding when tied); K and V of all layers up to the position, in fp16."""
    c = model.config
    weights = 0
    for name, t in model.tensors.items():
        if name == "token_embd.weight":
            weights += t.nbytes // c.vocab * (1 if not c.tied else c.vocab)
        else:
            weights += t.nbytes
    kv = int(2 * c.n_layers * c.n_kv_heads * c.head_dim * 2 * position)
    return weights, kv


def _peak_memory() -> int | None:
    get = getattr(mx, "get_peak_memory", None)
    return int(get()) if get else None


def run_decode(name: str, qtype: str, prompt: int, gen: int, seed: int = 0, modes=("step",),
               repeat: int = 1, depth=0, peak_gbs: float | None = None,
               variants=("reference",), kv=("contiguous",), ctx: int | None = None,
               rounds: int = 1, peer=None, past_context: bool = False,
               arms: list[dict] | None = None) -> list[dict]:
    """llama-bench's matrix: load (or make) the model once; for each variant build its decoder
    once, and for each depth (one or several, as llama-bench's -d) and mode, per repetition,
    prefill `depth` + `prompt` random tokens and greedily generate `gen`, timed apart (a warm-up
    run first: compilation and first-use costs are reported as compile_s, not timed). One row per
    (variant, depth, mode) with llama-bench's fields and the roofline: weight and KV bytes per
    token, effective GB/s, % of `peak_gbs` when known. Each kernel variant runs over each KV
    layout of `kv` (a paged one is named <variant>/paged in the rows); the reference variant
    over the contiguous cache only. `ctx`: the KV cache's rows (default depth + prompt + gen for
    each depth; one given size serves every depth); fewer make the decode steps wrap around
    (circular overflow), over the contiguous cache only. `past_context`: depth + prompt + gen may
    pass the model's trained context (speed only, as llama-bench's -d: RoPE and the caches take
    any position; the logits mean nothing there for a real model).

    `peer` (a harness.peers.LlamaBench): llama.cpp timed on the same file, same prompt, gen,
    depths and repeats, after lathe's rows in each of `rounds` rounds (lathe, llama.cpp, lathe,
    llama.cpp, ...: drift between the two shows as a difference between rounds). Every row
    names its round; a decoder is kept across rounds when it is the only one, else rebuilt.

    `arms` (option sets, as `--ab`): each kernel variant runs once under each set in every round,
    its decoder built and timed inside it, so the sets alternate on one machine with the peer
    between rounds; each row's `options` names its set (over the run's own options).
    """
    from harness import peers

    modes, variants = _names(modes, MODES, "mode"), _names(variants, VARIANTS, "variant")
    layouts = _names(kv, KV_LAYOUTS, "kv")
    depths = _depths(depth)
    if repeat < 1 or rounds < 1:
        raise ValueError(f"repeat and rounds must be at least 1, got {repeat} and {rounds}")
    path = model_file(name, qtype, seed)
    model = load_gguf(path)
    qtype = file_type_name(model)  # what the file holds (a preset's is --qtype), never the flag's default
    c = model.config
    deepest = max(depths)
    if past_context and deepest + prompt + gen > c.ctx:  # the decoders size caches up to the config's context
        print(f"decode {name}: depth + prompt + gen = {deepest + prompt + gen} is past the model's trained "
              f"context of {c.ctx} (past_context): a speed measurement only", file=sys.stderr, flush=True)
        c = model.config = dataclasses.replace(c, ctx=deepest + prompt + gen)
    if prompt < 1 or gen < 1 or deepest + prompt + gen > c.ctx:
        raise ValueError(f"depth + prompt + gen = {deepest + prompt + gen} must be in 2..{c.ctx} "
                         f"(the context; past it with past_context), with prompt and gen at least 1")
    if ctx is not None and not deepest + prompt <= ctx <= c.ctx:
        raise ValueError(f"ctx must hold depth + prompt = {deepest + prompt} tokens and be at most the "
                         f"model's {c.ctx}, got {ctx}")
    wrap = ctx is not None and ctx < deepest + prompt + gen
    if wrap and "megafused" in variants:
        raise ValueError(f"ctx {ctx} < depth + prompt + gen = {deepest + prompt + gen}: decode wraps around "
                         f"(circular overflow), which the megafused variant does not do")
    if wrap and "paged" in layouts and set(variants) - {"reference"}:
        raise ValueError(f"ctx {ctx} < depth + prompt + gen = {deepest + prompt + gen}: decode wraps "
                         f"around (circular overflow), which the paged cache does not do")
    tokens = np.random.default_rng(seed).integers(0, c.vocab, deepest + prompt)
    params = sum(int(np.prod(shape)) for shape in tensor_shapes(c).values())  # quantized or not
    common = dict(model=name, qtype=qtype, size_mb=round(path.stat().st_size / 2**20, 1),
                  params_m=round(params / 1e6, 1), repeat=repeat)
    rows = []
    # the reference and megafused variants take the contiguous cache only
    arms = arms or [{}]
    pairs = [(v, k, i) for v in variants for k in layouts if v not in ("reference", "megafused") or k == "contiguous"
             for i in range(len(arms))]
    described = [options.describe_under(arm) for arm in arms]  # each arm's options column
    kept = {}  # the one decoder of a single-variant matrix (and its breakdown), across rounds
    failed: dict[tuple[str, str, int], str] = {}  # (variant, layout, arm) -> why it did not run
    for rnd in range(1, rounds + 1):
        tag = dict(round=rnd) if rounds > 1 or peer else {}
        for variant, layout, arm in pairs:
            done = len(rows)
            try:
                if (variant, layout, arm) in failed:
                    raise _Failed(failed[(variant, layout, arm)])
                with options.use(**arms[arm]):
                    _time_variant(rows, kept, model, name, qtype, variant, layout, tokens, depths, modes, prompt,
                                  gen, repeat, ctx, wrap, peak_gbs, dict(common, options=described[arm]), tag,
                                  len(pairs))
            except Exception as exc:  # noqa: BLE001 - a variant that fails is a row; the matrix goes on
                why = str(exc) if isinstance(exc, _Failed) or str(exc).startswith(type(exc).__name__) \
                    else f"{type(exc).__name__}: {exc}"
                if len(pairs) == 1 and peer is None:  # nothing else to run: the error itself, as before
                    raise
                if (variant, layout, arm) not in failed:
                    print(f"lathe decode: {variant}{'/paged' if layout == 'paged' else ''}"
                          f"{' (' + options.describe(arms[arm]) + ')' if arms[arm] else ''} failed, the matrix goes "
                          f"on: {why}", file=sys.stderr, flush=True)
                failed[(variant, layout, arm)] = why
                rows.extend(_error_rows(rows[done:], dict(common, options=described[arm]), variant, layout, depths,
                                        modes, prompt, gen, tag, why))
                gc.collect()
        if peer is not None:
            began = time.perf_counter()
            try:
                tests = peer.run(path, prompt, gen, depths, repeat)
            except peers.PeerError as exc:  # lathe's rows still count; the caller sees no peer rows
                print(f"lathe decode: llama.cpp failed, no more peer runs: {exc}", file=sys.stderr, flush=True)
                peer = None
                continue
            found = peers.peer_rows(tests, prompt, gen, depths, dict(common, **tag),
                                    lambda position, tok_s: roofline(*traffic(model, position), tok_s, peak_gbs))
            for row in found:
                print(f"decode {name} {qtype} d{row['depth']} llama.cpp{_round(tag)}: {row['decode_tok_s']} tok/s "
                      f"(llama-bench {row['peer_build']}); {time.perf_counter() - began:.1f} s",
                      file=sys.stderr, flush=True)
            rows += found
    return rows


class _Failed(Exception):
    """A variant that failed in an earlier round: its error again, without running it again."""


def _time_variant(rows: list, kept: dict, model, name: str, qtype: str, variant: str, layout: str, tokens,
                  depths: list[int], modes: list[str], prompt: int, gen: int, repeat: int, ctx, wrap: bool,
                  peak_gbs, common: dict, tag: dict, n_pairs: int) -> None:
    """One (variant, KV layout) of a round of run_decode's matrix: its decoder built (or kept from
    the round before where it is the only one), then a row a depth and mode, appended to rows as
    they are measured."""
    built = time.perf_counter()
    if (variant, layout) in kept:
        decoder, split = kept[(variant, layout)]
    else:
        decoder = make_decoder(model, ctx or depths[0] + prompt + gen, variant, layout, overflow=wrap)
        split = breakdown(decoder, tokens[max(depths):], min(gen, 32))
        if n_pairs == 1:
            kept[(variant, layout)] = decoder, split
    built = time.perf_counter() - built
    for d in depths:
        if ctx is None:
            decoder.resize(d + prompt + gen)
        weights, kv_bytes = traffic(model, d + prompt + (gen - 1) / 2)  # at the mean decode position
        for mode in modes:
            timed = _time_mode(decoder, tokens, d, prompt, gen, mode, repeat)
            at = min(d + prompt + gen // 2, decoder.max_seq - 1)  # the mean decode position
            rows.append(dict(common, backend=_backend(), variant=getattr(decoder, "label", decoder.variant),
                             mode=mode, **timed, **split, **tag,
                             dispatches_per_token=dispatches_per_token(decoder, at, mode),
                             **roofline(weights, kv_bytes, timed["decode_tok_s"], peak_gbs)))
            arm = f" ({common['options']})" if common.get("options") else ""
            print(f"decode {name} {qtype} d{d} {rows[-1]['variant']}{arm} {mode}{_round(tag)}: "
                  f"{rows[-1]['decode_tok_s']} tok/s; {rows[-1].pop('_elapsed'):.1f} s (warm-up "
                  f"{rows[-1]['compile_s']:.1f}), decoder built in {built:.1f} s", file=sys.stderr, flush=True)
            built = 0.0
    if n_pairs > 1:
        del decoder  # one variant's weights on the device at a time
        gc.collect()


def _error_rows(made: list[dict], common: dict, variant: str, layout: str, depths: list[int], modes: list[str],
                prompt: int, gen: int, tag: dict, why: str) -> list[dict]:
    """The rows a failed variant did not make this round (a depth and mode each, past those it made
    before it failed), each with the error and no timings."""
    label = f"{variant}/paged" if layout == "paged" else variant
    have = {(r["depth"], r["mode"]) for r in made}
    return [dict(common, backend=_backend(), variant=label, mode=mode, depth=d, prompt=prompt, gen=gen,
                 test=f"pp{prompt}+tg{gen}" + (f" @ d{d}" if d else ""), error=why, **tag)
            for d in depths for mode in modes if (d, mode) not in have]


def roofline(weights: int, kv: int, tok_s: float, peak_gbs: float | None) -> dict:
    """A decode row's traffic fields: weight and KV MiB a token reads, the GB/s that makes at
    tok_s, and its % of the measured peak when known."""
    gbs = (weights + kv) * tok_s / 1e9
    return dict(weight_mb=round(weights / 2**20, 2), kv_mb=round(kv / 2**20, 3), gbs=round(gbs, 2),
                pct_roofline=round(100 * gbs / peak_gbs, 2) if peak_gbs else None)


def dispatches_per_token(decoder, pos: int, mode: str) -> int:
    """Kernel launches a decode token at pos makes in `mode` (a kernel variant's, recorded: the
    argmax and any second launch of a step included; the compiled modes pass the position as an
    array); the reference variant's plan steps (MLX ops, each of which may launch more)."""
    count = getattr(decoder, "launches_per_token", None)
    return count(pos, mode.startswith("compiled")) if count else len(decoder.plan)


def _time_mode(decoder, tokens, depth: int, prompt: int, gen: int, mode: str, repeat: int) -> dict:
    """One (depth, mode) of the matrix: a warm-up run, then `repeat` timed runs, each after
    `depth` tokens put in the cache untimed; the row's timing fields."""
    began = time.perf_counter()
    decoder.reset()
    start = time.perf_counter()
    generate(decoder, tokens[: min(4, prompt)], 2, mode)  # warm-up: first-use costs stay out
    # ... and those of the prompt at its depth (its plan, kernel instantiations and grids differ
    # from a short prompt's at position 0), so the prefill column times the prompt alone.
    decoder.reset()
    if depth:
        mx.eval(decoder.forward(tokens[:depth]))
    mx.eval(prompt_forward(decoder, tokens[depth:depth + prompt], mode, last_only=True))  # generate()'s path
    compile_s = time.perf_counter() - start
    reset = getattr(mx, "reset_peak_memory", None)
    if reset:
        reset()
    runs = []
    for _ in range(repeat):
        decoder.reset()
        # The fresh caches (a zero fill a layer's K and V) and the context already there, evaluated
        # here so that no timer counts them: llama-bench's cache exists before its pp is timed
        mx.eval(decoder.cache_arrays())
        if depth:
            mx.eval(decoder.forward(tokens[:depth]))
        runs.append(generate(decoder, tokens[depth:depth + prompt], gen, mode))
    decode = np.array([r.decode_tok_s for r in runs])
    prefill = np.array([r.prefill_tok_s for r in runs])
    return dict(
        test=f"pp{prompt}+tg{gen}" + (f" @ d{depth}" if depth else ""), depth=depth, prompt=prompt, gen=gen,
        prefill_tok_s=round(float(prefill.mean()), 1),
        decode_tok_s=round(float(decode.mean()), 1),
        decode_tok_s_std=round(float(decode.std()), 1),
        ms_per_token=round(1e3 / float(decode.mean()), 3),
        ms_per_token_min=round(1e3 / float(decode.max()), 3),  # the fastest repeat
        ms_per_token_max=round(1e3 / float(decode.min()), 3),
        peak_memory_mb=round(_peak_memory() / 2**20, 1) if _peak_memory() else None,
        compile_s=round(compile_s, 3), _elapsed=time.perf_counter() - began)


def _depths(depth) -> tuple[int, ...]:
    """One depth or several (a list, or a string such as "0,4096", as llama-bench's -d)."""
    if isinstance(depth, str):
        try:
            depth = [int(d) for d in depth.split(",")]
        except ValueError:
            raise ValueError(f"depth must be a number or comma-separated numbers, got {depth!r}") from None
    found = tuple(int(d) for d in (depth if isinstance(depth, (list, tuple)) else [depth]))
    if not found or min(found) < 0 or len(set(found)) != len(found):
        raise ValueError(f"depths must be distinct and at least 0, got {found}")
    return found


def _round(tag: dict) -> str:
    return f" (round {tag['round']})" if tag else ""


def breakdown(decoder, prompt, n: int) -> dict:
    """Where a step-mode token's time goes, medians over n tokens after the prompt: build_ms, the
    host building the token's graph (forward() and the argmax: Python, the kernel wrappers, MLX's
    op calls); eval_ms, mx.eval of that graph (MLX encodes each op on the host and the GPU runs
    them; the host waits). Their sum is the step-mode time per token."""
    decoder.reset()
    token = decoder.greedy(decoder.forward(prompt))
    mx.eval(token)
    build, run = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        token = decoder.greedy(decoder.forward(token))
        t1 = time.perf_counter()
        mx.eval(token)
        build.append(t1 - t0)
        run.append(time.perf_counter() - t1)
    return dict(build_ms=round(1e3 * float(np.median(build)), 3),
                eval_ms=round(1e3 * float(np.median(run)), 3))


def _names(value, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A name or a list of names (a string may list several, comma-separated, as llama-bench)."""
    names = tuple(value.split(",")) if isinstance(value, str) else tuple(value)
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise ValueError(f"{what} must be among {allowed}, got {bad or 'none'}")
    return names


def decode_row(run: dict, peak_gbs: float | None, device: str, meta: dict) -> dict:
    """A results/<device>/decode.csv row from run_decode's fields (us = time per decoded token at
    the mean tok/s, us_min / us_max at the fastest / slowest repeat's; bytes = weight + KV bytes
    it reads). A variant that failed keeps its error and no timings."""
    from harness.peers import VARIANT

    if "options" in run and run["variant"] != VARIANT:  # the options its arm ran under (run_decode's arms)
        meta = dict(meta, options=run["options"])
    if run.get("error"):
        return dict(benchmark="decode", kernel=run["model"], variant=run["variant"], backend=run["backend"],
                    device=device, us=None, gbs=None, pct_peak=None, peak_gbs=peak_gbs, bytes=None,
                    repeats=run["repeat"], **meta, model=run["model"], qtype=run["qtype"], mode=run["mode"],
                    depth=run["depth"], prompt=run["prompt"], gen=run["gen"], prefill_tok_s=None,
                    decode_tok_s=None, ms_per_token=None, pct_roofline=None, round=run.get("round"),
                    error=run["error"])
    us = run["ms_per_token"] * 1e3
    nbytes = int((run["weight_mb"] + run["kv_mb"]) * 2**20)

    if run["variant"] == VARIANT:  # llama.cpp takes none of lathe's options
        meta = dict(meta, options="")
    # the repeats' spread: us a token of the fastest and of the slowest repeat
    return dict(benchmark="decode", kernel=run["model"], variant=run["variant"],
                backend=run["backend"], device=device, us=round(us, 3), gbs=run["gbs"],
                us_min=round(run["ms_per_token_min"] * 1e3, 3), us_max=round(run["ms_per_token_max"] * 1e3, 3),
                pct_peak=run["pct_roofline"], peak_gbs=peak_gbs, bytes=nbytes,
                repeats=run["repeat"], compile_s=run["compile_s"], **meta,
                model=run["model"], qtype=run["qtype"], mode=run["mode"], depth=run["depth"],
                prompt=run["prompt"], gen=run["gen"], prefill_tok_s=run["prefill_tok_s"],
                decode_tok_s=run["decode_tok_s"], ms_per_token=run["ms_per_token"],
                dispatches_per_token=run["dispatches_per_token"], pct_roofline=run["pct_roofline"],
                round=run.get("round"), x_llama_cpp=run.get("x_llama_cpp"), peer_build=run.get("peer_build"))
