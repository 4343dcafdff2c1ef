"""The decode loop's small kernels (kernels.loop) against reference/loop.py and reference/quant.py:
RMSNorm (of fp16 or float32 rows) and residual + RMSNorm, SwiGLU and GeGLU, argmax (ties
planted), embedding rows from F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS and K-quant (reference/kquant.py) tables; odd sizes included, outputs poisoned. Benchmarks against the MLX built-in doing the
same at decode sizes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from harness.bench import BenchCase
from harness.check import CheckCase, Comparison, compare, exact, within_fp16_steps
from reference import formats
from reference import loop as ref

TOL = 2e-3


def _rmsnorm_case(m: int, k: int, residual: bool, wide: bool = False) -> CheckCase:
    """`wide`: x float32 of magnitudes past fp16's (1e5: Gemma's residual stream)."""
    from kernels.loop import rmsnorm
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        x = (rng.standard_normal((m, k)) * (1e5 if wide else 3)).astype(np.float32 if wide else np.float16)
        r = rng.standard_normal((m, k)).astype(np.float16)
        gamma = rng.uniform(0.5, 1.5, k).astype(np.float16)
        with poisoned_outputs():
            out = rmsnorm(mx.array(x), mx.array(gamma), 1e-5, mx.array(r) if residual else None)
            mx.eval(out)
        if not residual:
            return [compare("y", np.array(out), ref.rmsnorm(x, gamma, 1e-5), TOL)]
        s = (x.astype(np.float32) + r.astype(np.float32)).astype(np.float16)  # rounded like the kernel
        return [exact("x + residual", np.array(out[1]), s),
                compare("y", np.array(out[0]), ref.rmsnorm(s, gamma, 1e-5), TOL)]

    name = "residual_rmsnorm" if residual else "rmsnorm_x32" if wide else "rmsnorm"
    return CheckCase("loop", name, "kernel", dict(M=m, K=k), run)


def _post_norm_add_case(m: int, k: int) -> CheckCase:
    """stream + RMSNorm(x) * gamma (Gemma's post-block norms): x fp16, the stream float32 at
    magnitudes past fp16's."""
    from kernels.loop import post_norm_add
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        x = (rng.standard_normal((m, k)) * 40).astype(np.float16)
        stream = (rng.standard_normal((m, k)) * 1e5).astype(np.float32)
        gamma = rng.uniform(0.5, 700, k).astype(np.float16)
        with poisoned_outputs():
            out = post_norm_add(mx.array(x), mx.array(gamma), 1e-6, mx.array(stream))
            mx.eval(out)
        normed = ref.rmsnorm(x, gamma, 1e-6)
        got = np.array(out).astype(np.float64)
        return [compare("stream + RMSNorm(x) * gamma", got, stream.astype(np.float64) + normed, 1e-6),
                compare("what was added (float32 steps of the stream aside)", got - stream, normed, TOL)]

    return CheckCase("loop", "post_norm_add", "kernel", dict(M=m, K=k), run)


def _swiglu_case(m: int, f: int, activation: str = "silu") -> CheckCase:
    from kernels.loop import swiglu
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        gu = (rng.standard_normal((m, 2 * f)) * 2).astype(np.float16)
        with poisoned_outputs():
            y = swiglu(mx.array(gu), activation)
            mx.eval(y)
        return [compare("y", np.array(y), ref.swiglu(gu, activation), TOL)]

    return CheckCase("loop", "swiglu" if activation == "silu" else f"swiglu_{activation}", "kernel", dict(M=m, F=f), run)


def _argmax_case(m: int, v: int, dtype: str = "float32") -> CheckCase:
    from kernels.loop import argmax
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        logits = rng.standard_normal((m, v)).astype(dtype)
        for row in range(m):  # a tie for the maximum: the first index must win
            spots = rng.choice(v, size=min(v, 3), replace=False)
            logits[row, spots] = logits[row].max() + 1.0
        # The last row alone, as the decode loop passes it (a view that starts past row 0).
        last = mx.array(logits)[-1:]
        with poisoned_outputs(-7):
            tok, tail = argmax(mx.array(logits)), argmax(last)
            mx.eval(tok, tail)
        want = ref.argmax(logits.astype(np.float32))
        return [exact("token ids", np.array(tok), want), exact("last row", np.array(tail), want[-1:])]

    return CheckCase("loop", f"argmax_{dtype}", "kernel", dict(M=m, V=v), run)


def _argmax_words_case(m: int, v: int) -> CheckCase:
    """argmax's host words (serve's steps of up to 32 sequences): the tokens, and tokens_from_words of the
    words, against numpy's argmax (ties to the first index), an odd M's last word half written."""
    from kernels.loop import argmax, tokens_from_words
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        logits = rng.standard_normal((m, v)).astype(np.float16)
        for row in range(m):
            logits[row, rng.choice(v, size=3, replace=False)] = logits[row].max() + 1
        with poisoned_outputs(-7):
            tok, words = argmax(mx.array(logits), host_words=True)
            mx.eval(tok, *words)
        want = ref.argmax(logits.astype(np.float32))
        return [exact("token ids", np.array(tok), want),
                exact("host words", np.array(tokens_from_words(words, m)), want)]

    return CheckCase("loop", "argmax_float16", "host words", dict(M=m, V=v), run)


def _embed_case(qtype: str, t: int, k: int, vocab: int) -> CheckCase:
    from kernels.loop import embed
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        w = (rng.standard_normal((vocab, k)) * 0.1).astype(np.float16)
        ids = rng.integers(0, vocab, t)
        ids[-1] = ids[0]  # a repeated id
        if qtype == "f16":
            table, want = w, w[ids]
        else:
            table = formats.quantize(w.astype(np.float32), qtype.upper())
            want = formats.dequantize(table[ids], qtype.upper(), k)
        with poisoned_outputs():
            out = embed(mx.array(table), ids.tolist(), qtype, k)
            dev = embed(mx.array(table), mx.array(ids.astype(np.int32)), qtype, k)
            mx.eval(out, dev)
        if qtype in ("q4_k", "q5_k", "q4_1", "q5_1", "q5_0", "iq4_xs"):
            # d * sc * q - dmin * m (legacy: d * q + m, d * (q - 16)): the GPU may fuse the product
            # into the sum (one rounding, not two), as in kernels.gemv.dequantize: within one fp16
            # step (IQ4_XS: d * (ls - 32) * level, the two products in either order)
            return [within_fp16_steps(f"rows ({how} ids, fp16 steps from the reference)", np.array(got), want)
                    for how, got in (("host", out), ("device", dev))]
        want = want.astype(np.float16)
        return [exact("rows (host ids)", np.array(out), want),
                exact("rows (device ids)", np.array(dev), want)]

    return CheckCase("loop", f"embed_{qtype}", "kernel", dict(T=t, K=k, V=vocab), run)


def check_cases(small: bool = False) -> list[CheckCase]:
    cases = []
    for m, k in ((1, 8), (3, 72), (1, 4096), (17, 4104)) if not small else ((1, 8), (3, 72)):
        cases += [_rmsnorm_case(m, k, False), _rmsnorm_case(m, k, True), _rmsnorm_case(m, k, False, wide=True),
                  _post_norm_add_case(m, k)]
    for m, f in ((1, 8), (5, 3080), (1, 14336)) if not small else ((1, 8),):
        cases += [_swiglu_case(m, f), _swiglu_case(m, f, "gelu")]
    # V: tiny, odd (scalar loads only), 16-byte rows of float but not of half (4 | V, not 8),
    # vocabularies (Llama 2, Llama 3 and Qwen3: 1024 threads and 16-byte loads).
    for m, v in ((1, 1), (2, 33), (3, 8196), (1, 32000), (2, 128256), (4, 151936)) if not small else ((1, 1), (2, 33)):
        for dtype in ("float32", "float16"):
            cases.append(_argmax_case(m, v, dtype))
    for m, v in ((1, 151936), (8, 151936), (9, 128256), (32, 151936)) if not small else ((3, 65),):
        cases.append(_argmax_words_case(m, v))
    for qtype in ("f16", "q8_0", "q4_0"):
        for t, k, vocab in ((1, 32, 7), (5, 96, 300), (16, 4096, 1000)) if not small else ((1, 32, 7),):
            cases.append(_embed_case(qtype, t, k, vocab))
    for qtype in ("q4_1", "q5_0", "q5_1"):  # the legacy affine blocks
        for t, k, vocab in ((1, 32, 7), (5, 96, 300), (16, 640, 1000)) if not small else ((1, 32, 7),):
            cases.append(_embed_case(qtype, t, k, vocab))
    for qtype in ("iq4_nl", "iq4_xs"):  # the importance-matrix 4-bit blocks (IQ4_XS: whole super-blocks)
        for t, k, vocab in ((1, 256, 7), (5, 768, 300), (16, 1024, 1000)) if not small else ((1, 256, 7),):
            cases.append(_embed_case(qtype, t, k, vocab))
    for qtype in ("q4_k", "q5_k", "q6_k"):  # rows of whole super-blocks
        for t, k, vocab in ((1, 256, 7), (5, 768, 300), (16, 4096, 1000)) if not small else ((1, 256, 7),):
            cases.append(_embed_case(qtype, t, k, vocab))
    return cases


def reference_cases() -> list[CheckCase]:
    def run(rng: np.random.Generator) -> list[Comparison]:
        x = rng.standard_normal((3, 64)).astype(np.float32)
        g = rng.standard_normal(64).astype(np.float32)
        theirs = mx.fast.rms_norm(mx.array(x), mx.array(g), 1e-5, stream=mx.cpu)
        gu = rng.standard_normal((2, 32)).astype(np.float32)
        a, b = mx.array(gu[:, :16]), mx.array(gu[:, 16:])
        silu = a * mx.sigmoid(a) * b
        return [compare("rmsnorm vs mx.fast.rms_norm", np.array(theirs), ref.rmsnorm(x, g, 1e-5), 1e-5),
                compare("swiglu vs MLX ops", np.array(silu), ref.swiglu(gu), 1e-5)]

    return [CheckCase("loop", "reference.loop", "vs mlx (cpu, fp32)", dict(K=64), run, needs_gpu=False)]


def bench_cases(quick: bool = False) -> list[BenchCase]:
    from kernels import loop

    k, f, vocab = 4096, 14336, 128256
    x = lambda: mx.random.normal((1, k)).astype(mx.float16)  # noqa: E731

    def state():
        return {"x": x(), "r": x(), "g": (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16),
                "gu": mx.random.normal((1, 2 * f)).astype(mx.float16),
                "logits": mx.random.normal((1, vocab)),
                "logits16": mx.random.normal((1, vocab)).astype(mx.float16),
                "table": mx.random.normal((vocab, k)).astype(mx.float16) * 0.1,
                "ids": mx.array([17], dtype=mx.int32)}

    def case(kernel, variant, shape, step, nbytes):
        shape = {c: shape.get(c, "") for c in ("M", "K", "F", "V", "T")}  # one schema for all ops
        return BenchCase("loop", "loop-decode", kernel, variant, shape, state, step, nbytes, 0, nbytes)

    return [
        case("rmsnorm", "ours", dict(M=1, K=k), lambda s: [loop.rmsnorm(s["x"], s["g"], 1e-5)], 6 * k),
        case("rmsnorm", "mx.fast.rms_norm", dict(M=1, K=k), lambda s: [mx.fast.rms_norm(s["x"], s["g"], 1e-5)], 6 * k),
        case("residual_rmsnorm", "ours", dict(M=1, K=k),
             lambda s: list(loop.rmsnorm(s["x"], s["g"], 1e-5, s["r"])), 10 * k),
        case("residual_rmsnorm", "mx add + rms_norm", dict(M=1, K=k),
             lambda s: [mx.fast.rms_norm(s["x"] + s["r"], s["g"], 1e-5)], 10 * k),
        case("swiglu", "ours", dict(M=1, F=f), lambda s: [loop.swiglu(s["gu"])], 6 * f),
        case("swiglu", "mx ops", dict(M=1, F=f),
             lambda s: [s["gu"][:, :f] * mx.sigmoid(s["gu"][:, :f]) * s["gu"][:, f:]], 6 * f),
        case("argmax", "ours", dict(M=1, V=vocab), lambda s: [loop.argmax(s["logits"])], 4 * vocab),
        case("argmax", "mx.argmax", dict(M=1, V=vocab), lambda s: [mx.argmax(s["logits"], axis=-1)], 4 * vocab),
        # fp16, as the output head writes them (the decode loop's greedy step reads these)
        case("argmax_f16", "ours", dict(M=1, V=vocab), lambda s: [loop.argmax(s["logits16"])], 2 * vocab),
        case("argmax_f16", "mx.argmax", dict(M=1, V=vocab), lambda s: [mx.argmax(s["logits16"], axis=-1)],
             2 * vocab),
        case("embed_f16", "ours", dict(T=1, K=k), lambda s: [loop.embed(s["table"], s["ids"], "f16", k)], 4 * k),
        case("embed_f16", "mx take", dict(T=1, K=k), lambda s: [s["table"][s["ids"]]], 4 * k),
    ]
