"""The layer blocks (kernels.blocks): attention_block and ffn_block, each one launch on CUDA.

Checks: each block against reference/blocks.py in float64 on the dequantized weights, over the
real layers' shapes (Qwen3-0.6B, Llama-3.2-1B, Llama-3-8B) and tails; the attention block at
short and split contexts, the position on the host and on the device, with its head norms
(Qwen3) and without, cache rows past the token NaN (the block must write row pos before it reads
it, and touch no other row); each launched twice on one queue, which it must leave zero.
Reference self-check (CPU): reference/blocks.py against MLX's own float32 ops.
Benchmarks: each block against the launches it replaces in the fused decode loop, on each
model's shapes at a short and a long context (the `fused sequence` rows).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from harness.bench import BenchCase
from harness.check import CheckCase, Comparison, compare, compare_residual, exact
from harness.suites.gemv import _blocks, _packed_once, dequantize
from reference import blocks as ref
from reference.quant import storage_bytes

TOL = 4e-3  # a chain of GEMVs with X' staged as int16, fp16 intermediates, fp32 softmax
STORED = np.float16  # what the blocks keep QKV and the attention output in (the references round there too)
EPS = 1e-6
THETA = 1000000.0

# (d_model, n_heads, n_kv_heads, head_dim, head norms, NeoX) of the models the loop runs
MODELS = {
    "qwen3-0.6b": (1024, 16, 8, 128, True, True),
    "llama3.2-1b": (2048, 32, 8, 64, False, False),
    "llama3-8b": (4096, 32, 8, 128, False, False),
}
FFN = {"qwen3-0.6b": (1024, 3072), "llama3.2-1b": (2048, 8192), "llama3-8b": (4096, 14336)}
BENCH_QTYPE = {"qwen3-0.6b": "q8_0", "llama3.2-1b": "q8_0", "llama3-8b": "q4_0"}


# A file's mix of block types, as a case's `mix`: (matrix, layer, type) where it is not the case's
# qtype. llama.cpp's Q4_K_M: attn_v and ffn_down Q6_K in some layers, beside Q4_K ("v", "down").
Mix = tuple[tuple[str, int, str], ...]


def _type_of(qtype: str, mix: Mix, name: str, layer: int = 0) -> str:
    return next((t for n, at, t in mix if n == name and at == layer), qtype)


def _attention_mats(rng: np.random.Generator, qtype: str, mix: Mix, layer: int, d_model: int, heads: tuple[int, int],
                    head_dim: int):
    """A layer's attention matrices: repacked for the device ({"qkv", "o"}, and "v" apart where
    mix gives any layer's V a type of its own: kernels.blocks' w_v) and as float64 ({"qkv": all of
    [q; k; v], "o"})."""
    from kernels.gemv import repack

    n_heads, n_kv = heads
    split_v = any(name == "v" for name, _, _ in mix)
    shapes = dict(qkv=((n_heads + (1 if split_v else 2) * n_kv) * head_dim, d_model),
                  **({"v": (n_kv * head_dim, d_model)} if split_v else {}), o=(d_model, n_heads * head_dim))
    dev, w64 = {}, {}
    for name, (n, k) in shapes.items():
        t = _type_of(qtype, mix, name, layer)
        host, blocks = _blocks(rng, t, n, k, centered=True)
        dev[name], w64[name] = repack(blocks, t, n, k), dequantize(host, t, k)
    if split_v:
        w64["qkv"] = np.concatenate([w64["qkv"], w64.pop("v")])
    return dev, w64


def _ffn_mats(rng: np.random.Generator, qtype: str, mix: Mix, layer: int, d_model: int, f: int):
    """A layer's FFN matrices: repacked ({"gate_up", "down"}) and as float64 ({"gate_up", "down"})."""
    from kernels.gemv import concat_rows, repack

    host_gate, dev_gate = _blocks(rng, qtype, f, d_model, centered=True)
    host_up, dev_up = _blocks(rng, qtype, f, d_model, centered=True)
    t = _type_of(qtype, mix, "down", layer)
    host_down, dev_down = _blocks(rng, t, d_model, f, centered=True)
    dev = dict(gate_up=repack(concat_rows([dev_gate, dev_up]), qtype, 2 * f, d_model), down=repack(dev_down, t, d_model, f))
    w64 = dict(gate_up=np.concatenate([dequantize(host_gate, qtype, d_model), dequantize(host_up, qtype, d_model)]),
               down=dequantize(host_down, t, f))
    return dev, w64


def _gamma(rng: np.random.Generator, n: int, dtype=np.float16) -> np.ndarray:
    return rng.uniform(0.5, 1.5, n).astype(dtype)


def _caches(rng: np.random.Generator, n_kv: int, max_seq: int, head_dim: int, pos: int):
    """K and V caches holding random rows 0..pos-1 and NaN from pos on: a block must write row pos
    before it reads it, and touch no other row."""
    kc = np.full((n_kv, max_seq, head_dim), np.nan, np.float16)
    vc = np.full_like(kc, np.nan)
    kc[:, :pos] = rng.standard_normal((n_kv, pos, head_dim))
    vc[:, :pos] = rng.standard_normal((n_kv, pos, head_dim))
    return kc, vc


def _attention_checks(launch_: int, x: np.ndarray, got: tuple, want: tuple, kc: np.ndarray, vc: np.ndarray,
                      pos: int, queue: mx.array) -> list[Comparison]:
    """A block ending in attention: x_out (its added part, compare_residual: the residual would
    dominate), K and V of row pos, every other cache row bit for bit, and the queue left zero."""
    x_out, k_new, v_new = got
    want_x, k_want, v_want = want
    out = np.array(x_out).astype(np.float64)[0]
    k_got, v_got = np.array(k_new), np.array(v_new)
    others = np.arange(kc.shape[1]) != pos
    return [compare_residual(f"x_out - x (launch {launch_})", out, want_x, x, TOL),
            compare(f"K row pos (launch {launch_})", k_got[:, pos], k_want[:, pos], TOL),
            compare(f"V row pos (launch {launch_})", v_got[:, pos], v_want[:, pos], TOL),
            exact(f"other rows untouched (launch {launch_})",
                  np.stack([k_got[:, others], v_got[:, others]]).view(np.uint16),
                  np.stack([kc[:, others], vc[:, others]]).view(np.uint16)),
            exact(f"queue left zero (launch {launch_})", int(np.array(queue).sum()), 0)]


def _launched_twice(rng: np.random.Generator, queue: mx.array, d_model: int, cache: tuple[int, int, int], pos: int,
                    device_pos: bool, block, reference) -> list[Comparison]:
    """A block ending in attention, launched twice on one queue, each time over fresh x and caches
    (rows past pos NaN): block(x, k_cache, v_cache, pos) on the device, reference(x, kc, vc) in
    float64, compared by _attention_checks."""
    from kernels.runtime import poisoned_outputs

    checks = []
    for launch_ in range(2):
        kc, vc = _caches(rng, *cache, pos)
        x = rng.standard_normal((1, d_model)).astype(np.float16)
        at = mx.array(np.array([pos], np.int32)) if device_pos else pos
        with poisoned_outputs():
            got = block(mx.array(x), mx.array(kc), mx.array(vc), at)
            mx.eval(*got, queue)
        checks += _attention_checks(launch_, x[0], got, reference(x, kc, vc), kc, vc, pos, queue)
    return checks


def _variant(qtype: str, head_norm: bool, neox: bool, split: bool, device_pos: bool, mix: Mix = ()) -> str:
    mixed = {}
    for name, layer, t in mix:
        mixed.setdefault((name, t), []).append(str(layer))
    return " ".join(filter(None, (qtype, *(f"{n}:{t}@{','.join(at)}" for (n, t), at in mixed.items()),
                                  "head-norm" if head_norm else "", "neox" if neox else "",
                                  "split" if split else "", "device-pos" if device_pos else "")))


def _attention_case(qtype: str, d_model: int, heads: tuple[int, int], head_dim: int, head_norm: bool,
                    neox: bool, pos: int, device_pos: bool = False, split_from: int | None = None,
                    mix: Mix = ()) -> CheckCase:
    from kernels.attention import SPLIT_FROM
    from kernels.blocks import attention_block, block_queue

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        w, w64 = _attention_mats(rng, qtype, mix, 0, d_model, heads, head_dim)
        norm = _gamma(rng, d_model)
        q_norm, k_norm = (_gamma(rng, head_dim, np.float32) for _ in range(2)) if head_norm else (None, None)
        queue = block_queue()

        def block(x, kc, vc, at):
            return attention_block(x, mx.array(norm), EPS, w["qkv"], w["o"], qtype, kc, vc, at, n_heads=n_heads,
                                   theta=THETA, neox=neox, q_norm=None if q_norm is None else mx.array(q_norm),
                                   k_norm=None if k_norm is None else mx.array(k_norm), queue=queue,
                                   split_from=SPLIT_FROM if split_from is None else split_from, w_v=w.get("v"))

        def reference(x, kc, vc):
            return ref.attention_block(x[0], norm, EPS, w64["qkv"], w64["o"], kc, vc, pos, n_heads, THETA, neox,
                                       q_norm, k_norm, stored=STORED)

        return _launched_twice(rng, queue, d_model, (n_kv, pos + 9, head_dim), pos, device_pos, block, reference)

    variant = _variant(qtype, head_norm, neox, split_from == 0 or pos >= 2048, device_pos, mix)
    shape = dict(d_model=d_model, heads=f"{n_heads}/{n_kv}", D=head_dim, pos=pos)
    return CheckCase("blocks", "attention_block", variant, shape, run)


def _ffn_case(qtype: str, m: int, d_model: int, f: int, mix: Mix = ()) -> CheckCase:
    from kernels.blocks import block_queue, ffn_block
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        w, w64 = _ffn_mats(rng, qtype, mix, 0, d_model, f)
        norm = _gamma(rng, d_model)
        queue = block_queue()
        checks = []
        for launch_ in range(2):
            x = rng.standard_normal((m, d_model)).astype(np.float16)
            with poisoned_outputs():
                y = ffn_block(mx.array(x), mx.array(norm), EPS, w["gate_up"], w["down"], qtype, queue=queue)
                mx.eval(y, queue)
            want = ref.ffn_block(x, norm, EPS, w64["gate_up"], w64["down"])
            checks += [compare_residual(f"x_out - x (launch {launch_})", np.array(y), want, x, TOL),
                       exact(f"queue left zero (launch {launch_})", int(np.array(queue).sum()), 0)]
        return checks

    return CheckCase("blocks", "ffn_block", _variant(qtype, False, False, False, False, mix),
                     dict(M=m, d_model=d_model, F=f), run)


def _layer_case(qtype: str, d_model: int, f: int, heads: tuple[int, int], head_dim: int, head_norm: bool,
                neox: bool, pos: int, device_pos: bool = False, split_from: int | None = None,
                mix: Mix = ()) -> CheckCase:
    """layer_block: a layer's FFN, then the next layer's attention, in one launch, against the two
    references composed (the attention's K and V rows and untouched rows as _attention_case).
    `mix`'s layer 0 is both halves'."""
    from kernels.attention import SPLIT_FROM
    from kernels.blocks import block_queue, layer_block

    n_heads, n_kv = heads

    def run(rng: np.random.Generator) -> list[Comparison]:
        w, w64 = _ffn_mats(rng, qtype, mix, 0, d_model, f)
        attn_w, attn_w64 = _attention_mats(rng, qtype, mix, 0, d_model, heads, head_dim)
        w.update(attn_w)
        w64.update(attn_w64)
        ffn_norm, attn_norm = _gamma(rng, d_model), _gamma(rng, d_model)
        q_norm, k_norm = (_gamma(rng, head_dim, np.float32) for _ in range(2)) if head_norm else (None, None)
        queue = block_queue()

        def block(x, kc, vc, at):
            return layer_block(x, mx.array(ffn_norm), w["gate_up"], w["down"], mx.array(attn_norm), w["qkv"], w["o"],
                               EPS, qtype, kc, vc, at, n_heads=n_heads, theta=THETA, neox=neox,
                               q_norm=None if q_norm is None else mx.array(q_norm),
                               k_norm=None if k_norm is None else mx.array(k_norm), queue=queue,
                               split_from=SPLIT_FROM if split_from is None else split_from, w_v=w.get("v"))

        def reference(x, kc, vc):
            mid = ref.ffn_block(x, ffn_norm, EPS, w64["gate_up"], w64["down"])[0]
            return ref.attention_block(mid, attn_norm, EPS, w64["qkv"], w64["o"], kc, vc, pos, n_heads, THETA, neox,
                                       q_norm, k_norm, stored=STORED)

        return _launched_twice(rng, queue, d_model, (n_kv, pos + 5, head_dim), pos, device_pos, block, reference)

    variant = _variant(qtype, head_norm, neox, split_from == 0 or pos >= 2048, device_pos, mix)
    shape = dict(d_model=d_model, F=f, heads=f"{n_heads}/{n_kv}", D=head_dim, pos=pos)
    return CheckCase("blocks", "layer_block", variant, shape, run)


def _layers(rng: np.random.Generator, qtype: str, mix: Mix, layers: int, d_model: int, f: int,
            heads: tuple[int, int], head_dim: int, head_norm: bool):
    """`layers` layers' matrices, repacked ([{"gate_up", "down", "qkv", "o"(, "v")}] a layer) and
    as float64, and their norms ({"attn", "ffn"(, "q", "k")}: [layers, width])."""
    w, w64 = [], []
    for i in range(layers):
        (dev, f64), (attn_dev, attn_f64) = (_ffn_mats(rng, qtype, mix, i, d_model, f),
                                            _attention_mats(rng, qtype, mix, i, d_model, heads, head_dim))
        w.append({**dev, **attn_dev})
        w64.append({**f64, **attn_f64})
    norms = {name: np.stack([_gamma(rng, d_model) for _ in range(layers)]) for name in ("attn", "ffn")}
    if head_norm:
        norms.update({name: np.stack([_gamma(rng, head_dim, np.float32) for _ in range(layers)])
                      for name in ("q", "k")})
    return w, w64, norms


def _cache_rows_checks(launch_: int, caches: list, wants: list, k_new, v_new, new: np.ndarray,
                       queue: mx.array) -> list[Comparison]:
    """A token block's caches after a launch: each layer's new K and V rows `new` against the
    reference's (layer i's tolerance i + 1 blocks'), every other row bit for bit as it was, and
    the queue left zero."""
    checks = []
    for i, ((kc, vc), (k_want, v_want)) in enumerate(zip(caches, wants)):
        k_got, v_got = np.array(k_new[i]), np.array(v_new[i])
        others = np.ones(kc.shape[1], bool)
        others[new] = False
        checks += [compare(f"layer {i} K, V rows {'/'.join(map(str, new))} (launch {launch_})",
                           np.stack([k_got[:, new], v_got[:, new]]), np.stack([k_want[:, new], v_want[:, new]]),
                           TOL * (i + 1)),
                   exact(f"layer {i} other rows untouched (launch {launch_})",
                         np.stack([k_got[:, others], v_got[:, others]]).view(np.uint16),
                         np.stack([kc[:, others], vc[:, others]]).view(np.uint16))]
    checks.append(exact(f"queue left zero (launch {launch_})", int(np.array(queue).sum()), 0))
    return checks


def _token_case(qtype: str, d_model: int, f: int, heads: tuple[int, int], head_dim: int, head_norm: bool,
                neox: bool, layers: int, pos: int, device_pos: bool = False, split_from: int | None = None,
                mix: Mix = (), gemma: tuple[int, float] | None = None, bias: bool = False,
                stacked: bool = False) -> CheckCase:
    """token_block: `layers` layers of one decode token in one launch (stacked weights, a cache
    pair a layer, or with `stacked` every layer's K in one array and V in another) against the references of each layer's attention and FFN blocks in turn, the
    residual stream stored as fp16 between blocks as the kernel stores it; every layer's K and V
    rows and untouched rows as _attention_case; launched twice on one queue. Rounding (fp16
    intermediates, X' staged as int16) compounds through the layers: layer i's rows and the output
    of `layers` layers take i + 1 and `layers` times a block's tolerance (a wrong layer offset or
    cache is off by the size of the values).
    gemma (window, softcap): Gemma's layers (kernels.blocks.LayerKind): a float32 stream with
    post-block norms, a GELU gate, even layers sliding over `window` positions at RoPE base 10000
    and the others global at THETA (a table a layer), an attention scale of its own, and scores
    softcapped where softcap > 0 (Gemma 2). bias: Qwen2's Q, K and V biases a layer (fp16, the
    size of the projection's outputs), added in the QKV phase."""
    from kernels import options
    from kernels.attention import SPLIT_FROM
    from kernels.blocks import LLAMA, LayerKind, LayerStacks, Stack, block_queue, token_block
    from kernels.runtime import poisoned_outputs
    from reference.rope import inv_freq

    n_heads, n_kv = heads
    window, softcap = gemma or (0, 0.0)
    kind = LayerKind(True, True, "gelu", softcap) if gemma else LayerKind(qkv_bias=True) if bias else LLAMA
    windows = [window if i % 2 == 0 else 0 for i in range(layers)]
    thetas = [10000.0 if w else THETA for w in windows]
    scale = (1.5 * head_dim) ** -0.5 if gemma else None

    def run(rng: np.random.Generator) -> list[Comparison]:
        w, w64, norms = _layers(rng, qtype, mix, layers, d_model, f, heads, head_dim, head_norm)
        if gemma:
            norms.update({name: np.stack([_gamma(rng, d_model) for _ in range(layers)])
                          for name in ("post_attn", "post_ffn")})
        post = {name: mx.array(norms[f"post_{name}"]) if gemma else None for name in ("attn", "ffn")}
        stack = lambda name: Stack([m[name] for m in w]) if name in w[0] else None  # noqa: E731
        n_qkv = (n_heads + 2 * n_kv) * head_dim
        biases = (rng.standard_normal((layers, n_qkv)) * 0.5).astype(np.float16) if bias else None
        stacks = LayerStacks(mx.array(norms["attn"]), stack("qkv"), stack("o"), mx.array(norms["ffn"]),
                             stack("gate_up"), stack("down"),
                             *((mx.array(norms["q"]), mx.array(norms["k"])) if head_norm else (None, None)),
                             w_v=stack("v"), post_attn_norm=post["attn"], post_ffn_norm=post["ffn"],
                             qkv_bias=None if biases is None else mx.array(biases))
        tables = mx.array(np.stack([inv_freq(head_dim, t) for t in thetas]).astype(np.float32)) if gemma else None
        max_seq = pos + 5
        queue = block_queue(5 * layers)
        checks = []
        for launch_ in range(2):
            caches = [_caches(rng, n_kv, max_seq, head_dim, pos) for _ in range(layers)]
            # Gemma's stream: float32, its scale as its embedding gives it (sqrt(d_model) x)
            x = (rng.standard_normal((1, d_model)) * (d_model ** 0.5 if gemma else 1)).astype(
                np.float32 if gemma else np.float16)
            at = mx.array(np.array([pos], np.int32)) if device_pos else pos
            def launch(on_queue: mx.array) -> list[mx.array]:  # (fresh copies of the caches)
                with poisoned_outputs():
                    k_in, v_in = ([mx.array(kc) for kc, _ in caches], [mx.array(vc) for _, vc in caches])
                    if stacked:
                        k_in = mx.array(np.stack([kc for kc, _ in caches]))
                        v_in = mx.array(np.stack([vc for _, vc in caches]))
                    return token_block(
                        mx.array(x), stacks, EPS, qtype, k_in, v_in, at, n_heads=n_heads, theta=THETA, neox=neox,
                        queue=on_queue, split_from=SPLIT_FROM if split_from is None else split_from, layer_kind=kind,
                        inv_freqs=tables, scale=scale, windows=windows if gemma else None)

            x_out, k_new, v_new = launch(queue)
            mx.eval(x_out, k_new, v_new, queue)
            if launch_ == 0:
                # block_act_codes and block_o_codes: the X' that the DOWN and O phases copy is the one
                # they would stage themselves, so both options the other way (a single token's o_codes:
                # on where auto leaves it off) must give the same bits (a fresh queue)
                alt_queue = block_queue(5 * layers)
                other = dict(block_act_codes=not options.get("block_act_codes"),
                             block_o_codes=options.get("block_o_codes") is not True)
                with options.use(**other):
                    x_alt = launch(alt_queue)[0]
                bits = lambda a: np.array(a).view(np.uint16 if a.dtype == mx.float16 else np.uint32)  # noqa: E731
                checks.append(exact("x_out with block_act_codes and block_o_codes the other way: the same bits",
                                    bits(x_alt), bits(x_out)))
                checks.append(exact("queue left zero with those options the other way", int(np.array(alt_queue).sum()), 0))
            # the stream between blocks as the kernel keeps it: fp16, or float32 (Gemma's, not rounded)
            kept = (lambda a: a) if gemma else (lambda a: a.astype(np.float16).astype(np.float64))  # noqa: E731
            want, rows = x[0].astype(np.float64), []
            for i in range(layers):
                mid, k_want, v_want = ref.attention_block(
                    want, norms["attn"][i], EPS, w64[i]["qkv"], w64[i]["o"], *caches[i], pos, n_heads, thetas[i], neox,
                    norms["q"][i] if head_norm else None, norms["k"][i] if head_norm else None, stored=STORED,
                    window=windows[i], scale=scale, softcap=softcap,
                    post_norm=norms["post_attn"][i] if gemma else None, bias=None if biases is None else biases[i])
                want = kept(ref.ffn_block(kept(mid)[None], norms["ffn"][i], EPS, w64[i]["gate_up"], w64[i]["down"],
                                          kind.activation, norms["post_ffn"][i] if gemma else None,
                                          STORED if gemma else None)[0])
                rows.append((k_want, v_want))
            out = np.array(x_out).astype(np.float64)[0]
            checks.append(compare_residual(f"x_out - x (launch {launch_})", out, want, x[0], TOL * layers))
            checks += _cache_rows_checks(launch_, caches, rows, k_new, v_new, np.array([pos]), queue)
        return checks

    variant = _variant(qtype, head_norm, neox, split_from == 0 or pos >= 2048, device_pos, mix)
    if gemma:
        variant += f" gemma window={window}" + (f" softcap={softcap:g}" if softcap else "")
    if bias:
        variant += " qkv-bias"
    if stacked:
        variant += " stacked-kv"
    shape = dict(d_model=d_model, F=f, heads=f"{n_heads}/{n_kv}", D=head_dim, layers=layers, pos=pos)
    return CheckCase("blocks", "token_block", variant, shape, run)


def _llama_stacks(rng: np.random.Generator, qtype: str, mix: Mix, layers: int, d_model: int, f: int,
                  heads: tuple[int, int], head_dim: int, head_norm: bool, bias: bool):
    """token_block's stacks of `layers` random llama / qwen3 layers (Qwen2's Q, K and V biases
    where `bias`): (LayerStacks, each layer's float64 matrices, the norms, the biases or None)."""
    from kernels.blocks import LayerStacks, Stack

    n_heads, n_kv = heads
    w, w64, norms = _layers(rng, qtype, mix, layers, d_model, f, heads, head_dim, head_norm)
    stack = lambda name: Stack([m[name] for m in w]) if name in w[0] else None  # noqa: E731
    n_qkv = (n_heads + 2 * n_kv) * head_dim
    biases = (rng.standard_normal((layers, n_qkv)) * 0.5).astype(np.float16) if bias else None
    stacks = LayerStacks(mx.array(norms["attn"]), stack("qkv"), stack("o"), mx.array(norms["ffn"]),
                         stack("gate_up"), stack("down"),
                         *((mx.array(norms["q"]), mx.array(norms["k"])) if head_norm else (None, None)),
                         w_v=stack("v"), qkv_bias=None if biases is None else mx.array(biases))
    return stacks, w64, norms, biases


def _batch_token_case(qtype: str, d_model: int, f: int, heads: tuple[int, int], head_dim: int, head_norm: bool,
                      neox: bool, layers: int, positions: tuple[int, ...], block_size: int = 16,
                      split_from: int | None = None, mix: Mix = (), bias: bool = False) -> CheckCase:
    """token_block's batch form: a decode token of each of len(positions) sequences (sequence b's
    at positions[b], rows 0..positions[b]-1 cached) through `layers` layers in one launch over a
    paged pool a layer, each sequence's blocks scattered over the pool, every other pool row NaN
    (the block must write each token's row at its own slot before it reads it, and touch no other
    row). Each sequence against _token_case's references over a contiguous copy of its rows;
    every layer's new K and V rows, the rest of each pool bit for bit, the queue left zero;
    launched twice on one queue."""
    from harness.suites.attention import _paged_state
    from kernels import options
    from kernels.attention import SPLIT_FROM
    from kernels.blocks import LLAMA, LayerKind, block_queue, token_block
    from kernels.runtime import poisoned_outputs
    from reference import attention as ref_attention
    from reference.attention import paged_tokens

    n_heads, n_kv = heads
    kind = LayerKind(qkv_bias=True) if bias else LLAMA
    batch = len(positions)
    unsplit = split_from is None and max(positions) < SPLIT_FROM  # (the attention phase in one walk)

    def run(rng: np.random.Generator) -> list[Comparison]:
        stacks, w64, norms, biases = _llama_stacks(rng, qtype, mix, layers, d_model, f, heads, head_dim, head_norm,
                                                   bias)
        queue = block_queue(5 * layers)
        at = np.asarray(positions, np.int64)
        checks = []
        for launch_ in range(2):
            # a pool a layer, one table: each sequence's blocks for its positions 0..pos, the new
            # token's row NaN as every row past the cached ones
            k_pool, v_pool, table = _paged_state(rng, [int(p) + 1 for p in at], n_kv, head_dim, block_size)
            slots = table[np.arange(batch), at // block_size] * block_size + at % block_size
            pools = []
            for i in range(layers):  # layer 0's rows as _paged_state wrote them, the others' fresh
                if i:
                    k_pool, v_pool = np.full_like(k_pool, np.nan), np.full_like(v_pool, np.nan)
                    for b in np.flatnonzero(at > 0):
                        pos = int(at[b])
                        t = np.arange(pos)
                        ref_attention.reshape_and_cache(
                            k_pool, v_pool, rng.standard_normal((pos, n_kv, head_dim)).astype(np.float16),
                            rng.standard_normal((pos, n_kv, head_dim)).astype(np.float16),
                            table[b, t // block_size] * block_size + t % block_size)
                k_pool[slots // block_size, :, :, slots % block_size, :] = np.nan
                v_pool[slots // block_size, :, :, slots % block_size] = np.nan
                pools.append((k_pool, v_pool))
            table = np.concatenate([table, np.zeros((batch, 1), np.int32)], axis=1)  # a spare entry: 0, unused
            x = rng.standard_normal((batch, d_model)).astype(np.float16)
            def launch(on_queue: mx.array) -> list[mx.array]:  # (fresh copies of the pools)
                with poisoned_outputs():
                    return token_block(
                        mx.array(x), stacks, EPS, qtype, [mx.array(kp) for kp, _ in pools],
                        [mx.array(vp) for _, vp in pools], mx.array(at.astype(np.int32)), n_heads=n_heads,
                        theta=THETA, neox=neox, queue=on_queue,
                        split_from=SPLIT_FROM if split_from is None else split_from, layer_kind=kind,
                        table=mx.array(table))

            x_out, k_new, v_new = launch(queue)
            mx.eval(x_out, k_new, v_new, queue)
            # block_o_codes (where the context is unsplit) and block_act_codes: the X' that the O
            # and DOWN phases copy is the one they would stage themselves, so each option the other
            # way must give the same bits (fresh pools and queue)
            for flipped in ["block_o_codes"] * unsplit + ["block_act_codes"] if launch_ == 0 else []:
                alt_queue = block_queue(5 * layers)
                with options.use(**{flipped: not options.get(flipped)}):
                    x_alt = launch(alt_queue)[0]
                checks.append(exact(f"x_out with {flipped} the other way: the same bits",
                                    np.array(x_alt).view(np.uint16), np.array(x_out).view(np.uint16)))
                checks.append(exact(f"queue left zero with {flipped} the other way", int(np.array(alt_queue).sum()), 0))
            kept = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731 - the fp16 stream
            got = np.array(x_out).astype(np.float64)
            for b, pos in enumerate(at):
                pos, max_seq = int(pos), int(pos) + 5
                want, rows = x[b].astype(np.float64), []
                for i in range(layers):
                    k_seq, v_seq = paged_tokens(*pools[i], table[b], pos)  # [pos, n_kv, D]
                    kc = np.full((n_kv, max_seq, head_dim), np.nan)
                    vc = np.full_like(kc, np.nan)
                    kc[:, :pos], vc[:, :pos] = k_seq.transpose(1, 0, 2), v_seq.transpose(1, 0, 2)
                    mid, k_want, v_want = ref.attention_block(
                        want, norms["attn"][i], EPS, w64[i]["qkv"], w64[i]["o"], kc, vc, pos, n_heads, THETA, neox,
                        norms["q"][i] if head_norm else None, norms["k"][i] if head_norm else None, stored=STORED,
                        bias=None if biases is None else biases[i])
                    want = kept(ref.ffn_block(kept(mid)[None], norms["ffn"][i], EPS, w64[i]["gate_up"],
                                              w64[i]["down"])[0])
                    rows.append((k_want[:, pos], v_want[:, pos]))
                checks.append(compare_residual(f"sequence {b} x_out - x (launch {launch_})", got[b], want, x[b],
                                               TOL * layers))
                for i, (k_want, v_want) in enumerate(rows):
                    k_got, v_got = paged_tokens(np.array(k_new[i]), np.array(v_new[i]), table[b], pos + 1)
                    checks.append(compare(f"sequence {b} layer {i} K, V row pos (launch {launch_})",
                                          np.stack([k_got[pos], v_got[pos]]), np.stack([k_want, v_want]),
                                          TOL * (i + 1)))
            # every pool row but the batch's new ones, bit for bit (NaN included)
            for i, (k_pool, v_pool) in enumerate(pools):
                k_got, v_got = np.array(k_new[i]), np.array(v_new[i])
                keep_k = np.ones(k_pool.shape[0] * block_size, bool)
                keep_k[slots] = False
                blk, off = np.nonzero(keep_k.reshape(k_pool.shape[0], block_size))
                checks.append(exact(f"layer {i} other pool rows untouched (launch {launch_})",
                                    np.concatenate([k_got[blk, :, :, off, :].ravel(), v_got[blk, :, :, off].ravel()])
                                    .view(np.uint16),
                                    np.concatenate([k_pool[blk, :, :, off, :].ravel(), v_pool[blk, :, :, off].ravel()])
                                    .view(np.uint16)))
            checks.append(exact(f"queue left zero (launch {launch_})", int(np.array(queue).sum()), 0))
        return checks

    variant = _variant(qtype, head_norm, neox, split_from == 0 or max(positions) >= 2048, True, mix)
    variant += f" batch={batch} paged bs={block_size}" + (" qkv-bias" if bias else "")
    shape = dict(d_model=d_model, F=f, heads=f"{n_heads}/{n_kv}", D=head_dim, layers=layers,
                 positions="/".join(str(p) for p in positions))
    return CheckCase("blocks", "token_block", variant, shape, run)


def _batch_token_cases(small: bool) -> list[CheckCase]:
    """token_block's batch form over the paged pool (serve's decode step), where it runs (one
    launch: kernels.backends.cross_group_waits; Metal has no batch form): up to
    kernels.blocks.BATCH_ROWS sequences at their own positions (one at 0), the models' layers, a
    split, a K mix with V apart and biases, tails (odd batches among them)."""
    from kernels import backends

    if not backends.cross_group_waits():
        return []
    d, hq, hkv, hd, norm, neox = MODELS["qwen3-0.6b"]
    cases = [_batch_token_case("q8_0", d, FFN["qwen3-0.6b"][1], (hq, hkv), hd, norm, neox, 2, (30, 0, 17, 45)),
             _batch_token_case("q8_0", d, FFN["qwen3-0.6b"][1], (hq, hkv), hd, norm, neox, 2,
                               (30, 0, 17, 45, 130, 5, 64, 221)),
             _batch_token_case("q8_0", 160, 96, (4, 2), 64, False, True, 2, (7, 0), block_size=32)]
    if not small:
        d, hq, hkv, hd, norm, neox = MODELS["llama3.2-1b"]
        cases.append(_batch_token_case("q4_0", d, FFN["llama3.2-1b"][1], (hq, hkv), hd, norm, neox, 2, (5, 33, 16)))
        d, hq, hkv, hd, norm, neox = MODELS["llama3-8b"]
        cases.append(_batch_token_case("q4_0", d, FFN["llama3-8b"][1], (hq, hkv), hd, norm, neox, 1, (40, 100, 3, 17)))
        cases.append(_batch_token_case("q4_0", d, FFN["llama3-8b"][1], (hq, hkv), hd, norm, neox, 1,
                                       (40, 100, 3, 17, 0, 61, 250, 9)))
        cases.append(_batch_token_case("q4_0", 1024, 3072, (16, 8), 128, True, True, 2, (700, 3, 1500), split_from=0))
        cases.append(_batch_token_case("q4_0", 1024, 3072, (16, 8), 128, True, True, 2, (700, 3, 1500, 33, 260),
                                       split_from=0))
        cases.append(_batch_token_case("q4_k", 256, 512, (4, 2), 64, False, True, 2, (9, 20, 2, 40),
                                       mix=(("v", 1, "q6_k"),), bias=True))
        cases.append(_batch_token_case("q4_k", 256, 512, (4, 2), 64, False, True, 2, (9, 20, 2, 40, 77, 1, 13),
                                       mix=(("v", 1, "q6_k"),), bias=True))
    return cases


def _prompt_token_case(qtype: str, d_model: int, f: int, heads: tuple[int, int], head_dim: int, head_norm: bool,
                       neox: bool, layers: int, pos: int, rows: int, stacked: bool = True,
                       split_from: int | None = None, mix: Mix = (), bias: bool = False) -> CheckCase:
    """token_block's prompt form: `rows` tokens of one sequence at pos, pos + 1, .. through
    `layers` layers in one launch over contiguous caches (rows 0..pos-1 cached, NaN from pos on:
    token b must see the rows tokens 0..b-1 write in the same launch, and no later one), against
    _token_case's references run a token at a time, each over the caches the tokens before it
    left; every layer's new K and V rows, every other row bit for bit, the queue left zero;
    launched twice on one queue."""
    from kernels.attention import SPLIT_FROM
    from kernels.blocks import LLAMA, LayerKind, block_queue, token_block
    from kernels.runtime import poisoned_outputs

    n_heads, n_kv = heads
    kind = LayerKind(qkv_bias=True) if bias else LLAMA

    def run(rng: np.random.Generator) -> list[Comparison]:
        stacks, w64, norms, biases = _llama_stacks(rng, qtype, mix, layers, d_model, f, heads, head_dim, head_norm,
                                                   bias)
        max_seq = pos + rows + 3
        new = np.arange(pos, pos + rows)
        queue = block_queue(5 * layers)
        checks = []
        for launch_ in range(2):
            caches = [_caches(rng, n_kv, max_seq, head_dim, pos) for _ in range(layers)]
            x = rng.standard_normal((rows, d_model)).astype(np.float16)
            with poisoned_outputs():
                k_in, v_in = ([mx.array(kc) for kc, _ in caches], [mx.array(vc) for _, vc in caches])
                if stacked:
                    k_in, v_in = (mx.array(np.stack([kc for kc, _ in caches])),
                                  mx.array(np.stack([vc for _, vc in caches])))
                x_out, k_new, v_new = token_block(
                    mx.array(x), stacks, EPS, qtype, k_in, v_in, pos, n_heads=n_heads, theta=THETA, neox=neox,
                    queue=queue, split_from=SPLIT_FROM if split_from is None else split_from, layer_kind=kind)
                mx.eval(x_out, k_new, v_new, queue)
            kept = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731 - the fp16 stream
            got = np.array(x_out).astype(np.float64)
            ref_caches = [(kc.copy(), vc.copy()) for kc, vc in caches]
            for b in range(rows):
                want = x[b].astype(np.float64)
                for i in range(layers):
                    mid, k_want, v_want = ref.attention_block(
                        want, norms["attn"][i], EPS, w64[i]["qkv"], w64[i]["o"], *ref_caches[i], pos + b, n_heads,
                        THETA, neox, norms["q"][i] if head_norm else None, norms["k"][i] if head_norm else None,
                        stored=STORED, bias=None if biases is None else biases[i])
                    ref_caches[i] = (k_want, v_want)
                    want = kept(ref.ffn_block(kept(mid)[None], norms["ffn"][i], EPS, w64[i]["gate_up"],
                                              w64[i]["down"])[0])
                checks.append(compare_residual(f"token {b} x_out - x (launch {launch_})", got[b], want, x[b],
                                               TOL * layers))
            checks += _cache_rows_checks(launch_, caches, ref_caches, k_new, v_new, new, queue)
        return checks

    variant = _variant(qtype, head_norm, neox, split_from == 0 or pos >= 2048, False, mix)
    variant += f" prompt rows={rows}" + (" stacked-kv" if stacked else "") + (" qkv-bias" if bias else "")
    shape = dict(d_model=d_model, F=f, heads=f"{n_heads}/{n_kv}", D=head_dim, layers=layers, pos=pos)
    return CheckCase("blocks", "token_block", variant, shape, run)


def _prompt_token_cases(small: bool) -> list[CheckCase]:
    """token_block's prompt form (a megafused short prompt), where it runs (one launch): the
    models' layers at depth 0 and past it, every row count's tail (2, 3, 5, 8), a split context,
    a K mix with V apart and biases, caches stacked and a layer each."""
    from kernels import backends

    if not backends.cross_group_waits():
        return []
    d, hq, hkv, hd, norm, neox = MODELS["qwen3-0.6b"]
    cases = [_prompt_token_case("q8_0", d, FFN["qwen3-0.6b"][1], (hq, hkv), hd, norm, neox, 2, 0, 8),
             _prompt_token_case("q8_0", d, FFN["qwen3-0.6b"][1], (hq, hkv), hd, norm, neox, 2, 37, 3, stacked=False),
             _prompt_token_case("q8_0", 160, 96, (4, 2), 64, False, True, 2, 5, 2)]
    if not small:
        d, hq, hkv, hd, norm, neox = MODELS["llama3-8b"]
        cases.append(_prompt_token_case("q4_0", d, FFN["llama3-8b"][1], (hq, hkv), hd, norm, neox, 1, 8, 8))
        cases.append(_prompt_token_case("q4_0", 1024, 3072, (16, 8), 128, True, True, 2, 700, 5, split_from=0))
        cases.append(_prompt_token_case("q4_k", 256, 512, (4, 2), 64, False, True, 2, 20, 8,
                                        mix=(("v", 1, "q6_k"),), bias=True))
    return cases


def check_cases(small: bool = False) -> list[CheckCase]:
    cases = []
    # the models' layers: a short context, then one split over partitions merged in the launch
    for name, (d, hq, hkv, hd, norm, neox) in MODELS.items():
        qtype = BENCH_QTYPE[name]
        cases.append(_attention_case(qtype, d, (hq, hkv), hd, norm, neox, 17, device_pos=True))
        if not small:
            cases.append(_attention_case("q4_0" if qtype == "q8_0" else "q8_0", d, (hq, hkv), hd, norm, neox, 0))
            cases.append(_attention_case(qtype, d, (hq, hkv), hd, norm, neox, 700, split_from=0))
            cases.append(_attention_case(qtype, d, (hq, hkv), hd, norm, neox, 2500, device_pos=True))
    # tails: small widths, head_dim 64 and 256, a group of one, many query heads to a kv head
    cases.append(_attention_case("q8_0", 160, (4, 2), 64, False, True, 3))
    cases.append(_attention_case("q4_0", 512, (4, 4), 256, True, True, 40))
    if not small:
        cases.append(_attention_case("q8_0", 256, (8, 1), 128, True, False, 300, split_from=0))
    for name, (d, f) in FFN.items():
        cases.append(_ffn_case(BENCH_QTYPE[name], 1, d, f))
        if not small:
            cases.append(_ffn_case("q4_0" if BENCH_QTYPE[name] == "q8_0" else "q8_0", 2, d, f))
    cases.append(_ffn_case("q8_0", 3, 160, 96))
    cases.append(_ffn_case("q4_0", 4, 96, 4128))
    # a layer's FFN and the next layer's attention: the models' layers, a split, tails
    for name, (d, hq, hkv, hd, norm, neox) in MODELS.items():
        if small and name == "llama3-8b":
            continue
        cases.append(_layer_case(BENCH_QTYPE[name], d, FFN[name][1], (hq, hkv), hd, norm, neox, 30, device_pos=True))
    if not small:
        cases.append(_layer_case("q4_0", 1024, 3072, (16, 8), 128, True, True, 3000))
        cases.append(_layer_case("q8_0", 2048, 8192, (32, 8), 64, False, False, 600, split_from=0))
    cases.append(_layer_case("q8_0", 160, 96, (4, 2), 64, False, True, 7))
    cases.append(_layer_case("q4_0", 96, 4128, (2, 1), 256, True, True, 2))
    # a whole token's layers in one launch: the small models' layers, a split, tails
    for name in ("qwen3-0.6b", "llama3.2-1b"):
        d, hq, hkv, hd, norm, neox = MODELS[name]
        cases.append(_token_case(BENCH_QTYPE[name], d, FFN[name][1], (hq, hkv), hd, norm, neox, 3, 30,
                                 device_pos=True))
    if not small:
        cases.append(_token_case("q4_0", 1024, 3072, (16, 8), 128, True, True, 2, 700, split_from=0))
        cases.append(_token_case("q4_0", 4096, 14336, (32, 8), 128, False, False, 2, 40))
        # ... and at 4300 tokens: under the bound its 4 query heads a kv head take 2 tickets
        # (attention_query_split on 132 SMs), the merge's slots in two runs
        cases.append(_token_case("q4_0", 4096, 14336, (32, 8), 128, False, False, 2, 4300, split_from=0))
    cases.append(_token_case("q8_0", 160, 96, (4, 2), 64, False, True, 4, 7))
    # Qwen3's heads unsplit past one chunk of K (128 tokens at 4 SIMD groups): the new row the
    # first chunk's last, then in the second (block_k_early fills the first chunk's slot only)
    if not small:
        d, hq, hkv, hd, norm, neox = MODELS["qwen3-0.6b"]
        for pos in (127, 200):
            cases.append(_token_case("q8_0", d, FFN["qwen3-0.6b"][1], (hq, hkv), hd, norm, neox, 2, pos))
    # partitions past two a lane of the merge: 2 kv heads aim at 256 of them (65, then 126 here;
    # each slot's in two runs)
    if not small:
        for pos in (8300, 16000):
            cases.append(_token_case("q8_0", 512, 768, (8, 2), 64, False, True, 2, pos, split_from=0))
        # Qwen3's heads at 4300 tokens: 34 partitions, each slot's in two runs (the merge's MSPLIT)
        cases.append(_token_case("q8_0", 1024, 3072, (16, 8), 128, True, True, 2, 4300, split_from=0))
    # every layer's K in one array and V in another (mega_kv_stacked, the megafused decoder's):
    # layer l read and written at its offset, unsplit and split
    d, hq, hkv, hd, norm, neox = MODELS["qwen3-0.6b"]
    cases.append(_token_case("q8_0", d, FFN["qwen3-0.6b"][1], (hq, hkv), hd, norm, neox, 3, 30, device_pos=True,
                             stacked=True))
    cases.append(_token_case("q4_0", 1024, 3072, (16, 8), 128, True, True, 3, 700, split_from=0, stacked=True))
    cases.append(_token_case("q4_0", 96, 4128, (2, 1), 256, True, True, 1, 2))
    # llama.cpp's K mixes (Q4_K_M, Q5_K_M): attn_v and ffn_down Q6_K in some layers only, V's rows
    # a matrix of their own; a K-quant beside Q4_0 too (every type but Q8_0 stages X' alike)
    d, hq, hkv, hd, norm, neox = MODELS["qwen3-0.6b"]
    cases.append(_token_case("q4_k", d, FFN["qwen3-0.6b"][1], (hq, hkv), hd, norm, neox, 3, 30, device_pos=True,
                             mix=(("v", 1, "q6_k"), ("down", 0, "q6_k"), ("down", 2, "q6_k"))))
    cases.append(_attention_case("q4_k", 256, (4, 2), 64, False, False, 9, mix=(("v", 0, "q6_k"),)))
    cases.append(_ffn_case("q5_k", 2, 256, 512, mix=(("down", 0, "q6_k"),)))
    cases.append(_layer_case("q4_0", 512, 768, (8, 2), 64, True, True, 5, mix=(("v", 0, "q4_k"), ("down", 0, "q6_k"))))
    if not small:
        d, hq, hkv, hd, norm, neox = MODELS["llama3-8b"]
        cases.append(_token_case("q4_k", d, FFN["llama3-8b"][1], (hq, hkv), hd, norm, neox, 2, 700, split_from=0,
                                 mix=(("v", 0, "q6_k"), ("down", 1, "q6_k"))))
        cases.append(_token_case("q5_k", 1024, 3072, (16, 8), 128, True, True, 3, 40,
                                 mix=(("v", 2, "q6_k"), ("down", 2, "q6_k"), ("down", 0, "q6_k"))))
    cases += _batch_token_cases(small)
    cases += _prompt_token_cases(small)
    # Qwen2.5-7B's widths on the llama layer: 7 query heads a kv head, one a threadgroup (QS = 7,
    # kernels.blocks.heads_split), down's row (K = 18944) whole beside them; and a down row past
    # the threadgroup's bytes (K = 24576): X' staged in chunks
    if not small:
        cases.append(_token_case("q4_0", 3584, 18944, (28, 4), 128, False, False, 2, 40))
    cases.append(_token_case("q4_0", 512, 24576, (4, 2), 128, False, False, 2, 40))
    # Qwen2's layers: Q, K and V biases in the QKV phase (Qwen2.5-0.5B's widths, NeoX pairs), and
    # with V's rows a matrix of their own (its biases after Q and K's)
    cases.append(_token_case("q8_0", 896, 4864, (14, 2), 64, False, True, 2, 30, device_pos=True, bias=True))
    cases.append(_token_case("q4_k", 256, 512, (4, 2), 64, False, True, 2, 9, mix=(("v", 1, "q6_k"),), bias=True))
    # Gemma's layers (float32 stream, post-norms, GELU, sliding and global layers): Gemma-3-270M's
    # shapes and the real file's mix (Q5_0 where rows of 640 are no whole super-block, its attn_v
    # Q8_0 in some layers: a Q8_0 GEMV reads X' staged in 32-value chunks), past the window
    gemma_mix = (("v", 1, "q8_0"), *(("o", i, "q4_k") for i in range(3)), ("down", 0, "q6_k"), ("down", 1, "q4_k"),
                 ("down", 2, "q6_k"))
    cases.append(_token_case("q5_0", 640, 2048, (4, 1), 256, True, True, 3, 30, device_pos=True, mix=gemma_mix,
                             gemma=(16, 0.0)))
    if not small:
        cases.append(_token_case("q5_0", 640, 2048, (4, 1), 256, True, True, 3, 700, split_from=0, mix=gemma_mix,
                                 gemma=(512, 0.0)))
        # Gemma 2's softcap; X' staged in Q8_0's 16-value chunks and read by 32-value GEMVs
        cases.append(_token_case("q8_0", 256, 512, (8, 4), 128, False, True, 2, 20, device_pos=True,
                                 mix=(("o", 0, "q4_k"), ("o", 1, "q4_k"), ("down", 1, "q4_0")), gemma=(8, 50.0)))
    return cases


def _reference_vs_mlx() -> CheckCase:
    """reference/blocks.py against MLX's float32 ops on the CPU (rms_norm, rope, sdpa): an
    independent opinion of the composition (head norms, NeoX pairs, GQA, the residuals)."""

    def run(rng: np.random.Generator) -> list[Comparison]:
        d, hq, hkv, hd, pos = 256, 8, 2, 64, 11
        x = rng.standard_normal(d)
        norm, q_norm, k_norm = rng.uniform(0.5, 1.5, d), rng.uniform(0.5, 1.5, hd), rng.uniform(0.5, 1.5, hd)
        w_qkv = rng.standard_normal(((hq + 2 * hkv) * hd, d)) * 0.05
        w_o = rng.standard_normal((d, hq * hd)) * 0.05
        kc, vc = rng.standard_normal((hkv, pos + 3, hd)), rng.standard_normal((hkv, pos + 3, hd))
        want, k_want, _ = ref.attention_block(x, norm, EPS, w_qkv, w_o, kc, vc, pos, hq, THETA, True, q_norm, k_norm)
        f32 = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
        with mx.stream(mx.cpu):
            qkv = mx.fast.rms_norm(f32(x)[None], f32(norm), EPS) @ f32(w_qkv).T
            q, k, v = mx.split(qkv[0], [hq * hd, (hq + hkv) * hd])
            q = mx.fast.rms_norm(q.reshape(hq, 1, hd), f32(q_norm), EPS)
            k = mx.fast.rms_norm(k.reshape(hkv, 1, hd), f32(k_norm), EPS)
            q = mx.fast.rope(q[None], hd, traditional=False, base=THETA, scale=1.0, offset=pos)
            k = mx.fast.rope(k[None], hd, traditional=False, base=THETA, scale=1.0, offset=pos)
            keys = mx.concatenate([f32(kc[:, :pos])[None], k], axis=2)
            values = mx.concatenate([f32(vc[:, :pos])[None], v.reshape(1, hkv, 1, hd)], axis=2)
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=hd ** -0.5)
            got = f32(x) + o.reshape(-1) @ f32(w_o).T
            mx.eval(got, keys)
        w_gu, w_d = rng.standard_normal((2 * 96, d)) * 0.05, rng.standard_normal((d, 96)) * 0.05
        xs = rng.standard_normal((2, d))
        with mx.stream(mx.cpu):
            h = mx.fast.rms_norm(f32(xs), f32(norm), EPS) @ f32(w_gu).T
            ffn = f32(xs) + (mx.sigmoid(h[:, :96]) * h[:, :96] * h[:, 96:]) @ f32(w_d).T
            mx.eval(ffn)
        return [compare("attention_block vs MLX float32", np.array(got), want, 1e-4),
                compare("K row pos vs MLX float32", np.array(keys)[0, :, pos], k_want[:, pos], 1e-4),
                compare("ffn_block vs MLX float32", np.array(ffn), ref.ffn_block(xs, norm, EPS, w_gu, w_d), 1e-4)]

    return CheckCase("blocks", "reference", "vs mlx float32 (cpu)", dict(d_model=256), run, needs_gpu=False)


def reference_cases() -> list[CheckCase]:
    return [_reference_vs_mlx()]


def _ordered(s: dict, out: mx.array) -> list[mx.array]:
    """A set's calls share its queue and merge counters, which MLX does not see written, so two
    of them must never run at once; and a decode token's blocks run one after the other, so the
    benchmark must not let them overlap either. The next call on the set takes this call's output
    as its x: a data dependency, which MLX's CUDA graph keeps (mx.depends on the queue alone did
    not order the launches: two ffn_blocks on one queue ran at once, and a wait that never ended
    trapped, logs/bench-blocks-llama3-8b-fault-29d96ff.log). The values of x do not change what
    the kernels do."""
    s["x"] = out
    s["queue"], s["counters"] = mx.depends([s["queue"], s["counters"]], [out])
    return [out]


def _bench_attention(path: str, model: str, ctx: int) -> BenchCase:
    """One decode token's attention half at context ctx (the token at position ctx - 1): the
    block in one launch, or the fused loop's launches (RMSNorm+QKV; Qwen3's head-norm + RoPE +
    KV write, then flash decode, Llama's RoPE inside attention; O + residual). Bytes: the two
    matrices, K and V of the context read, the new rows written."""
    import math

    from kernels import attention, gemv, rope
    from kernels.blocks import attention_block, block_queue

    d, hq, hkv, hd, norm, neox = MODELS[model]
    qtype = BENCH_QTYPE[model]
    n_qkv = (hq + 2 * hkv) * hd
    weights = _packed_once(qtype, (n_qkv, d), (d, hq * hd))
    pos = ctx - 1

    def make():
        w_qkv, w_o = weights()
        shape = (hkv, ctx, hd)
        return {"w_qkv": w_qkv, "w_o": w_o, "x": mx.random.normal((1, d)).astype(mx.float16),
                "norm": (1 + 0.1 * mx.random.normal((d,))).astype(mx.float16),
                "q_norm": 1 + 0.1 * mx.random.normal((hd,)), "k_norm": 1 + 0.1 * mx.random.normal((hd,)),
                "k": mx.random.normal(shape).astype(mx.float16), "v": mx.random.normal(shape).astype(mx.float16),
                "queue": block_queue(), "counters": attention.merge_counters(hq)}

    def block(s):
        x, s["k"], s["v"] = attention_block(s["x"], s["norm"], EPS, s["w_qkv"], s["w_o"], qtype, s["k"], s["v"], pos,
                                            n_heads=hq, theta=THETA, neox=neox, q_norm=s["q_norm"] if norm else None,
                                            k_norm=s["k_norm"] if norm else None, queue=s["queue"],
                                            counters=s["counters"])
        return _ordered(s, x)

    def sequence(s):
        qkv = gemv.rmsnorm_gemv(s["x"], s["norm"], EPS, s["w_qkv"], qtype, n_qkv, d)
        scale = 1.0 / math.sqrt(hd)
        if norm:  # as the fused loop runs Qwen3: head norms + RoPE + KV write, then attention
            rot = rope.head_norm_rope_neox_qkv_write(qkv, s["q_norm"], s["k_norm"], s["k"], s["v"], pos,
                                                     n_heads=hq, eps=EPS, theta=THETA)
            s["k"], s["v"] = rot.k_cache, rot.v_cache
            o = attention.flash_decode(rot.q.reshape(1, hq, hd), s["k"][None], s["v"][None], [ctx], scale,
                                       after=rot.written, counters=s["counters"])
        else:
            o, s["k"], s["v"] = attention.rope_flash_decode(qkv, s["k"], s["v"], pos, scale, n_heads=hq, theta=THETA,
                                                            neox=neox, counters=s["counters"])
        return _ordered(s, gemv.gemv_v3(o.reshape(1, -1), s["w_o"], qtype, d, hq * hd, residual=s["x"]))

    nbytes = (storage_bytes(qtype, n_qkv, d) + storage_bytes(qtype, d, hq * hd) + 2 * hkv * ctx * hd * 2
              + 2 * 2 * d)
    flops = 2 * (n_qkv * d + d * hq * hd) + 4 * hq * ctx * hd
    return BenchCase("blocks", "block-attention", "attention_block" if path == "block" else "fused sequence", model,
                     dict(ctx=ctx, d_model=d, F=0, heads=f"{hq}/{hkv}", D=hd, qtype=qtype), make,
                     block if path == "block" else sequence, nbytes, flops, nbytes)


def _bench_ffn(path: str, model: str) -> BenchCase:
    """The FFN half of a decode token: the block in one launch, or the fused loop's two
    (RMSNorm + gate+up with SiLU in its epilogue, then down + residual)."""
    from kernels import gemv
    from kernels.blocks import block_queue, ffn_block

    d, f = FFN[model]
    qtype = BENCH_QTYPE[model]
    weights = _packed_once(qtype, (2 * f, d), (d, f))

    def make():
        w_gu, w_down = weights()
        return {"w_gu": w_gu, "w_down": w_down, "x": mx.random.normal((1, d)).astype(mx.float16),
                "norm": (1 + 0.1 * mx.random.normal((d,))).astype(mx.float16), "queue": block_queue(),
                "counters": mx.zeros((1,), mx.uint32)}

    def block(s):
        return _ordered(s, ffn_block(s["x"], s["norm"], EPS, s["w_gu"], s["w_down"], qtype, queue=s["queue"]))

    def sequence(s):
        a = gemv.gate_up_swiglu(s["x"], s["w_gu"], qtype, 2 * f, d, gamma=s["norm"], eps=EPS)
        return _ordered(s, gemv.gemv_v3(a, s["w_down"], qtype, d, f, residual=s["x"]))

    nbytes = storage_bytes(qtype, 2 * f, d) + storage_bytes(qtype, d, f) + 2 * 2 * d
    return BenchCase("blocks", "block-ffn", "ffn_block" if path == "block" else "fused sequence", model,
                     dict(ctx=0, d_model=d, F=f, heads="", D=0, qtype=qtype), make, block if path == "block" else sequence,
                     nbytes, 2 * 3 * f * d, nbytes)


def _bench_layer(path: str, model: str, ctx: int) -> BenchCase:
    """A layer's FFN and the next layer's attention for one decode token (ctx: the attention's
    context): layer_block in one launch, or the fused loop's launches for the same work."""
    from kernels.blocks import block_queue, layer_block

    d, hq, hkv, hd, norm, neox = MODELS[model]
    f = FFN[model][1]
    qtype = BENCH_QTYPE[model]
    attn, ffn = _bench_attention("sequence", model, ctx), _bench_ffn("sequence", model)
    pos = ctx - 1

    def make():
        s = attn.make_set()
        s.update({k: v for k, v in ffn.make_set().items() if k in ("w_gu", "w_down")})
        s["ffn_norm"], s["queue"] = (1 + 0.1 * mx.random.normal((d,))).astype(mx.float16), block_queue()
        return s

    def block(s):
        x, s["k"], s["v"] = layer_block(s["x"], s["ffn_norm"], s["w_gu"], s["w_down"], s["norm"], s["w_qkv"], s["w_o"],
                                        EPS, qtype, s["k"], s["v"], pos, n_heads=hq, theta=THETA, neox=neox,
                                        q_norm=s["q_norm"] if norm else None, k_norm=s["k_norm"] if norm else None,
                                        queue=s["queue"], counters=s["counters"])
        return _ordered(s, x)

    def sequence(s):  # the FFN's two launches, then the attention's (its sequence, over their output)
        from kernels import gemv

        a = gemv.gate_up_swiglu(s["x"], s["w_gu"], qtype, 2 * f, d, gamma=s["ffn_norm"], eps=EPS)
        s["x"] = gemv.gemv_v3(a, s["w_down"], qtype, d, f, residual=s["x"])
        return attn.step(s)

    return BenchCase("blocks", "block-layer", "layer_block" if path == "block" else "fused sequence", model,
                     dict(ctx=ctx, d_model=d, F=f, heads=f"{hq}/{hkv}", D=hd, qtype=qtype), make,
                     block if path == "block" else sequence, attn.bytes + ffn.bytes, attn.flops + ffn.flops,
                     attn.set_bytes + ffn.set_bytes)


def _one_chain(case: BenchCase) -> BenchCase:
    """The case's calls in one chain over all its sets: each call takes the last call's output
    as its x, whichever set that was on. A decode token's layers run so, one after the other.
    Calls on different sets with no data between them MLX's CUDA graph runs side by side: the
    fused sequence's launches then overlapped the next set's, its busy time (gpu_us, the union
    of the kernels' intervals) counted the overlap once, and the blocks read 40% slower than
    the launches they replace where Nsight Compute, a kernel at a time, found 6-13%
    (kernels/loop/NOTES.md)."""
    last: dict[str, mx.array] = {}

    def step(s: dict) -> list[mx.array]:
        if "x" in last:
            s["x"] = last["x"]
        out = case.step(s)
        last["x"] = s["x"]  # _ordered left the output there
        return out

    return dataclasses.replace(case, step=step)


def bench_cases(quick: bool = False) -> list[BenchCase]:
    cases = []
    for model in MODELS:
        for path in ("block", "sequence"):  # alternated: rows of one run, side by side
            for ctx in (144,) if quick else (144, 4096):
                cases.append(_bench_attention(path, model, ctx))
            cases.append(_bench_ffn(path, model))
            cases.append(_bench_layer(path, model, 144))
    return [_one_chain(c) for c in cases]
