"""The quantized GEMV family (Q4_0, Q8_0; and the K-quants Q4_K, Q5_K, Q6_K on the v3 path).

Checks: GPU quantize/dequantize byte for byte against reference.quant; v1, v2 and v3 GEMV, the
fused RMSNorm+GEMV and SiLU+down, gate+up with SwiGLU in its epilogue, the seam (two GEMVs in one launch), the batched (M > 4) path, the
fused projections and v3's pair (two matrices of their own block types in one launch) against float64
on the dequantized weights, on odd small shapes and on real models' shapes, outputs poisoned.
Benchmarks (M = 1 unless said): v1 and v2 against MLX's fp16 matvec and quantized_matmul at
4 and 8 bits; fused against the unfused sequences; the batched path against repeated GEMVs over
M; and a sweep of v2's launch knobs. The K-quants: their repack byte for byte against
reference.kquant.pack, their GPU dequantize, and every v3 form (plain, fused prologues and
epilogues, gate+up with SwiGLU, fused projections, the batched path) against float64, on random
super-blocks (every byte random but the fp16 scales: any bit pattern the format allows); their
benchmarks beside Q4_0's v3 and MLX's 4/5/6-bit quantized_matmul at groups of 64 (4.5, 5.5, 6.5 bits a
weight: Q4_K's, Q5_K's, about Q6_K's).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pandas as pd

from harness.bench import BenchCase
from harness.check import CheckCase, Comparison, compare, compare_products, exact, within_fp16_steps
from reference import formats, rel_err
from reference import loop as ref_loop
from reference.quant import quantize

TOL = 2e-3
QTYPES = ("q4_0", "q8_0")
K_QTYPES = ("q4_k", "q5_k", "q6_k")  # the v3 GEMVs and dequantize (repacked weights only)
LEGACY_QTYPES = ("q4_1", "q5_0", "q5_1")  # the same (blocks of 32: the K-quants' code path)
IQ4_QTYPES = ("iq4_nl", "iq4_xs")  # the same (levels from a table; IQ4_XS rows of whole super-blocks)
WHOLE_SUPERS = (*K_QTYPES, "iq4_xs")  # rows of 256-weight super-blocks
# Legacy check shapes beyond the odd ones: Gemma-3-270M's (its Q5_0 q, k|v, gate|up: K = 640)
# and the 8B's, which the small list lacks
LEGACY_REAL = ((1024, 640), (512, 640), (4096, 640), (4096, 4096), (14336, 4096))
K_SMALL_K = (256, 768, 4352)  # K-quant rows are whole super-blocks of 256
SMALL_N = (1, 7, 33, 4097)
SMALL_K = (32, 96, 256, 4128)  # 256: the smallest K whose rows are 16-byte aligned
# N x K of real layers: Llama-3-8B q/o (4096 x 4096), k/v (1024 x 4096), gate/up (14336 x 4096),
# down (4096 x 14336), output (128256 x 4096); Qwen3-0.6B gate/up (3072 x 1024), down
# (1024 x 3072), output (151936 x 1024).
REAL = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (3072, 1024), (1024, 3072))
VOCAB = ((151936, 1024), (128256, 4096))
SAMPLED_FROM = 65536  # larger N: the float64 reference covers a sample of rows (all are checked finite)
HOST_QUANTIZE_UP_TO = 1 << 22  # weights; larger matrices are quantized by the (checked) GPU kernel


def dequantize(blocks: np.ndarray, qtype: str, k: int) -> np.ndarray:
    return formats.dequantize(blocks, qtype.upper(), k)


def storage_bytes(qtype: str, n: int, k: int) -> int:
    return n * formats.row_bytes(qtype.upper(), k)


def _weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    # Rows of different scales, as in real layers; fp16-exact values (the GPU quantizer's input).
    w = rng.standard_normal((n, k), dtype=np.float32) * rng.uniform(0.02, 0.2, (n, 1)).astype(np.float32)
    return w.astype(np.float16).astype(np.float32)


def _blocks(rng: np.random.Generator, qtype: str, n: int, k: int, centered: bool = False
            ) -> tuple[np.ndarray, mx.array]:
    """Random weights in `qtype` blocks, on the host and on the device. Larger matrices are drawn
    and quantized on the device (the quantizer is checked on its own, byte for byte): drawing
    them on the host was most of the suite's time (0.3 s a call on average). centered: K-quant
    weights of mean zero (_k_blocks); Q4_0 and Q8_0 weights are always."""
    if qtype in K_QTYPES:
        host = _k_blocks(rng, qtype, n, k, centered)
        return host, mx.array(host)
    if qtype in LEGACY_QTYPES or qtype in IQ4_QTYPES:
        host = _legacy_blocks(rng, qtype, n, k)
        return host, mx.array(host)
    if n * k <= HOST_QUANTIZE_UP_TO:
        host = quantize(_weights(rng, n, k), qtype)
        return host, mx.array(host)
    from kernels.gemv import quantize as gpu_quantize

    keys = mx.random.split(mx.random.key(int(rng.integers(1 << 31))))
    scales = mx.random.uniform(0.02, 0.2, (n, 1), key=keys[0])  # rows of different scales, as _weights
    dev = gpu_quantize((mx.random.normal((n, k), key=keys[1]) * scales).astype(mx.float16), qtype)
    mx.eval(dev)
    return np.array(dev), dev


# fp16 super-block scales of random K-quant blocks: weights of about 0.01-0.1 at the largest
# sub-block scales and levels (Q4_K/Q5_K d * 63 * 31, Q6_K d * 127 * 32)
K_SCALES = {"q4_k": (2e-5, 1e-4), "q5_k": (1e-5, 5e-5), "q6_k": (2e-6, 2e-5)}


def _k_blocks(rng: np.random.Generator, qtype: str, n: int, k: int, centered: bool = False) -> np.ndarray:
    """[n, k] in random `qtype` super-blocks: every byte random (levels, sub-block scales and
    mins, high bits: all the bit patterns the format allows) but the fp16 d (and dmin), which are
    drawn from K_SCALES so that the weights are of a real layer's size.

    centered (Q4_K, Q5_K): each sub-block's min tied to its scale (m = sc, dmin = d times the
    middle level), so that the weights average zero as a real layer's do. Independent random
    mins give the weights a mean close to their spread (Q4_K: 0.012 against a standard deviation
    of 0.015): one GEMV does not mind, but a chain
    of layers does (kernels.blocks' checks): the residual stream of two 8B-wide layers grew to
    1e4-7e4 and past fp16 in 3 of 17 seeds, the reference's own stream included. Q6_K's signed
    scales are centered already."""
    from reference import kquant

    size = formats.row_bytes(qtype.upper(), 256)
    blocks = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    lo, hi = K_SCALES[qtype]
    at = slice(208, 210) if qtype == "q6_k" else slice(0, 4)
    scales = rng.uniform(lo, hi, (blocks.shape[0], at.stop - at.start >> 1)).astype(np.float16)
    if centered and qtype != "q6_k":
        middle = (16 if qtype == "q4_k" else 32) / 2 - 0.5  # the mean of the levels 0 .. 2^bits - 1
        scales[:, 1] = (scales[:, 0].astype(np.float32) * middle).astype(np.float16)
        sc, _ = kquant.unpack_scales_mins(blocks[:, 4:16])
        blocks[:, 4:16] = kquant.pack_scales_mins(sc.astype(np.uint8), sc.astype(np.uint8))
    blocks[:, at] = scales.view(np.uint8)
    return blocks.reshape(n, -1)


def _legacy_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """[n, k] in random Q4_1, Q5_0 or Q5_1 blocks: every byte random (levels, fifth bits) but the
    fp16 d, of a real layer's weights (0.01-0.1 at the largest level), and m, centring the
    levels (Q4_1, Q5_1: a weight's mean about zero, as _k_blocks' centered form says why)."""
    per_block = 256 if qtype == "iq4_xs" else 32
    size = formats.row_bytes(qtype.upper(), per_block)
    blocks = rng.integers(0, 256, (n * k // per_block, size), dtype=np.uint8)
    if qtype in IQ4_QTYPES:  # d of a level 127 (IQ4_XS: times a scale up to 32): random scales and levels
        d = rng.uniform(0.01, 0.1, blocks.shape[0]) / (127 * (32 if qtype == "iq4_xs" else 1))
        blocks[:, :2] = d.astype(np.float16)[:, None].view(np.uint8)
        return blocks.reshape(n, -1)
    top = 15 if qtype == "q4_1" else 31
    d = rng.uniform(0.01, 0.1, blocks.shape[0]).astype(np.float32) / top
    heads = [d] if qtype == "q5_0" else [d, -d * top / 2]
    blocks[:, : 2 * len(heads)] = np.stack(heads, axis=1).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def _x(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    return rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)


def _rows_checked(rng: np.random.Generator, n: int) -> np.ndarray:
    if n < SAMPLED_FROM:
        return np.arange(n)
    return np.unique(np.concatenate([np.arange(256), np.arange(n - 256, n),
                                     rng.integers(0, n, 2048)]))


def _against_float64(name: str, y: mx.array, x64: np.ndarray, blocks: np.ndarray, qtype: str,
                     k: int, rng: np.random.Generator) -> list[Comparison]:
    """y = x64 @ W^T on the dequantized weights, in float64 (a sample of rows for vocab sizes),
    relative to the products' size where few outputs cancel (check.compare_products)."""
    out = np.array(y).astype(np.float64)
    rows = _rows_checked(rng, blocks.shape[0])
    w64 = dequantize(blocks[rows], qtype, k).astype(np.float64)
    checks = [compare_products(name, out[:, rows], x64 @ w64.T, x64, w64, TOL)]
    if len(rows) < blocks.shape[0]:
        checks.append(exact(f"{name}: every row finite", np.isfinite(out).all(), True))
    return checks


# ---- formats on the GPU ----------------------------------------------------------------------------
def _adversarial(rng: np.random.Generator, k: int) -> np.ndarray:
    """Rows of special blocks: zeros, max fp16 magnitude, negative extremes, ties of magnitude
    with opposite signs, tiny (subnormal) values, constant blocks, and random ones."""
    rows = [np.zeros(k), np.full(k, 65504.0), np.full(k, -65504.0),
            np.tile(np.r_[1.0, -1.0], k // 2), np.tile(np.r_[-3.0, 3.0], k // 2),
            np.full(k, 6e-8), rng.standard_normal(k) * 1e-5, np.full(k, 0.1),
            rng.integers(-8, 8, k).astype(np.float64), rng.standard_normal(k) * 1000]
    return np.stack(rows).astype(np.float16).astype(np.float32)


def _quantize_case(qtype: str, n: int, k: int, adversarial: bool = False) -> CheckCase:
    from kernels.gemv import dequantize as gpu_dequantize
    from kernels.gemv import quantize as gpu_quantize
    from kernels.gemv import repack
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        w = _adversarial(rng, k) if adversarial else _weights(rng, n, k)
        want = quantize(w, qtype)
        checks = []
        for poison in (0, 255):  # every byte is a legal value: a skipped one fails one of the two
            with poisoned_outputs(poison):
                q = gpu_quantize(mx.array(w.astype(np.float16)), qtype)
                mx.eval(q)
            checks.append(exact(f"blocks (outputs poisoned with {poison})", np.array(q), want))
        with poisoned_outputs():
            back = gpu_dequantize(mx.array(want), qtype, w.shape[0], k)
            back_packed = gpu_dequantize(repack(mx.array(want), qtype, w.shape[0], k), qtype, w.shape[0], k)
            mx.eval(back, back_packed)
        with np.errstate(over="ignore"):  # fp16 overflows to inf on both sides alike
            expected = dequantize(want, qtype, k).astype(np.float16)
        return checks + [exact("dequantized", np.array(back), expected),
                         exact("dequantized from the repacked blocks", np.array(back_packed), expected)]

    shape = dict(N="special" if adversarial else n, K=k)
    return CheckCase("gemv", f"quantize_{qtype}", "gpu", shape, run)


def _dequantize_k_case(qtype: str, n: int, k: int) -> CheckCase:
    """The K-quants' GPU dequantize against reference.kquant's float32 values (GGML's arithmetic),
    on blocks of GGML's quantizer over rows of every kind (Gaussian, heavy tails, zeros,
    constant, sparse, one sign), outputs poisoned. Q6_K's values are products only: fp16 of the
    reference, exactly. Q4_K and Q5_K subtract a min, and the GPU may fuse the product into the
    difference (one rounding, not two): within one fp16 step of the reference."""
    from kernels.gemv import dequantize as gpu_dequantize
    from kernels.gemv import repack
    from kernels.runtime import poisoned_outputs
    from reference import kquant, quant

    # Q4_1, Q5_0, Q5_1 and the IQ4s: the same checks on reference.quant's and reference.iquant's blocks
    from reference import iquant

    module, pack = ((quant, quant.pack_legacy) if qtype in LEGACY_QTYPES else (iquant, iquant.pack)
                    if qtype in IQ4_QTYPES else (kquant, kquant.pack))

    def run(rng: np.random.Generator) -> list[Comparison]:
        kinds = [rng.standard_normal(k) / 32, rng.standard_t(2, k), np.zeros(k), np.full(k, 0.37),
                 rng.standard_normal(k) * (rng.random(k) < 0.05), np.abs(rng.standard_normal(k))]
        w = np.stack([kinds[i % len(kinds)] if i < len(kinds) else rng.standard_normal(k) / 32
                      for i in range(n)]).astype(np.float32)
        blocks = module.quantize(w, qtype)
        packed = repack(mx.array(blocks), qtype, n, k)
        with poisoned_outputs():
            got = gpu_dequantize(mx.array(blocks), qtype, n, k)
            got_packed = gpu_dequantize(packed, qtype, n, k)
            mx.eval(got, got_packed)
        want = module.dequantize(blocks, qtype, k)
        checks = [exact(f"repacked bytes (reference.{module.__name__.split('.')[-1]}.{pack.__name__})",
                        np.array(packed.data), pack(blocks, qtype, n, k))]
        for label, out in (("dequantized", got), ("dequantized from the repacked blocks", got_packed)):
            out = np.array(out)
            if qtype == "q6_k":
                checks.append(exact(f"{label} (fp16 of the reference)", out, want.astype(np.float16)))
                continue
            checks.append(within_fp16_steps(f"{label} (fp16 steps from the reference)", out, want))
        return checks

    return CheckCase("gemv", f"dequantize_{qtype}", "gpu", dict(N=n, K=k), run)


# ---- GEMV and friends ------------------------------------------------------------------------------
def _gemv_case(version: str, qtype: str, m: int, n: int, k: int, residual: bool = False,
               knobs: dict | None = None) -> CheckCase:
    """`residual` (linear and qmm only): Y + R, R added in the same op (a GEMV's or qmm's epilogue,
    or mx.addmm for M >= BATCHED_FROM). `knobs`: qmm's launch knobs."""
    from kernels import gemv
    from kernels.runtime import poisoned_outputs

    fn = {"v1": gemv.gemv_v1, "v2": gemv.gemv_v2, "v3": gemv.gemv_v3, "linear": gemv.linear,
          "linear v3": gemv.linear, "qmm": gemv.qmm, "qmm rows8": gemv.qmm, "qmm mma": gemv.qmm_mma,
          "qmm mma rows8": gemv.qmm_mma}[version]
    extra = dict(knobs or {})

    def run(rng: np.random.Generator) -> list[Comparison]:
        host, dev = _blocks(rng, qtype, n, k)
        if version.endswith("v3") or version.startswith("qmm"):
            dev = gemv.repack(dev, qtype, n, k)
        if version.endswith("rows8"):  # W's row blocks interleaved (RowBlocks)
            dev = gemv.interleave_rows(dev)
        x = _x(rng, m, k)
        r = _x(rng, m, n) if residual else None
        with poisoned_outputs():
            y = fn(mx.array(x), dev, qtype, n, k, **(dict(residual=mx.array(r)) if residual else {}), **extra)
            mx.eval(y)
        if not residual:
            return _against_float64("y", y, x.astype(np.float64), host, qtype, k, rng)
        want = x.astype(np.float64) @ dequantize(host, qtype, k).astype(np.float64).T + r.astype(np.float64)
        return [compare("y + residual", np.array(y).astype(np.float64), want, TOL)]

    variant = version
    if version == "linear v3" and 4 < m <= gemv.QMM_UP_TO:
        variant = "linear v3 (qmm)"
    elif version.startswith("linear") and m >= gemv.BATCHED_FROM:
        variant = version.replace("linear", "batched")
    shape = dict(M=m, N=n, K=k, **{key.upper(): v for key, v in (knobs or {}).items()})
    return CheckCase("gemv", f"gemv_{qtype}", variant + (" + residual" if residual else ""), shape, run)


def rmsnorm64(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma.astype(np.float64)


def swiglu64(gate_up: np.ndarray) -> np.ndarray:
    g, u = np.split(gate_up.astype(np.float64), 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


def _fused_case(kind: str, qtype: str, m: int, n: int, k: int, residual: bool = False,
                knobs: dict | None = None, version: str = "v2", gemma: bool = False) -> CheckCase:
    """A prologue (rmsnorm: RMSNorm(X) * gamma; swiglu: silu(gate) * up; plain: X) and, with
    `residual`, the epilogue Y + R, against float64; `knobs`: launch knobs (kernels.gemv.gemv_v2,
    gemv_v3) in place of the tuned ones; `version` v3: on repacked weights. `gemma` (v3): Gemma's
    forms, the RMSNorm of a float32 X of magnitudes past fp16's, GELU in place of SiLU."""
    from kernels.gemv import gemv_v2, gemv_v3, repack, rmsnorm_gemv, silu_down_gemv
    from kernels.runtime import poisoned_outputs

    plain = gemv_v3 if version == "v3" else gemv_v2

    def run(rng: np.random.Generator) -> list[Comparison]:
        host, dev = _blocks(rng, qtype, n, k)
        if version == "v3":
            dev = repack(dev, qtype, n, k)
        r = _x(rng, m, n) if residual else None
        extra = dict(residual=mx.array(r)) if residual else {}
        extra.update(knobs or {})
        with poisoned_outputs():
            if kind == "rmsnorm":
                x = (_x(rng, m, k).astype(np.float32) * 3 + 1)
                x = x * 3e4 if gemma else x.astype(np.float16)  # Gemma: float32, |x| to 1e5
                gamma = rng.uniform(0.5, 1.5, k).astype(np.float16)
                y = rmsnorm_gemv(mx.array(x), mx.array(gamma), 1e-5, dev, qtype, n, k, **(knobs or {}))
                x64 = rmsnorm64(x, gamma, 1e-5)
            elif kind == "swiglu":
                x = (_x(rng, m, 2 * k).astype(np.float32) * 2).astype(np.float16)
                act = "gelu" if gemma else "silu"
                y = silu_down_gemv(mx.array(x), dev, qtype, n, k, activation=act, **extra)
                x64 = ref_loop.swiglu(x, act)
            else:
                x = _x(rng, m, k)
                y = plain(mx.array(x), dev, qtype, n, k, **extra)
                x64 = x.astype(np.float64)
            mx.eval(y)
        if not residual:
            return _against_float64("y", y, x64, host, qtype, k, rng)
        # y - r against x64 @ W^T: the residual is added in fp32 before the one rounding.
        want = x64 @ dequantize(host, qtype, k).astype(np.float64).T + r.astype(np.float64)
        return [compare("y + residual", np.array(y).astype(np.float64), want, TOL)]

    name = {"rmsnorm": "rmsnorm_gemv", "swiglu": "silu_down_gemv", "plain": "gemv"}[kind]
    variant = version + (" + residual" if residual else "") + (" gemma (float32 X, GELU)" if gemma else "")
    if knobs:
        variant += " " + ",".join(f"{key}={value}" for key, value in knobs.items())
    return CheckCase("gemv", f"{name}_{qtype}", variant, dict(M=m, N=n, K=k), run)


def _head_argmax_case(qtype: str, m: int, n: int, k: int, knobs: dict | None = None) -> CheckCase:
    """rmsnorm_gemv_argmax (an output head for greedy decoding): Y against float64 as rmsnorm_gemv's,
    each row's token against numpy's argmax over the Y it wrote (the first of equals). Then a second
    launch on the same scratch (whose counter the first must have left zero) with row 0's winner
    copied to an earlier and a later row, in other threadgroups where N allows: a tie, which the
    earlier row must win."""
    from kernels.gemv import head_argmax_scratch, repack, rmsnorm_gemv_argmax
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        host, dev = _blocks(rng, qtype, n, k)
        x = (_x(rng, m, k).astype(np.float32) * 3 + 1).astype(np.float16)
        gamma = rng.uniform(0.5, 1.5, k).astype(np.float16)
        scratch = head_argmax_scratch(qtype, n, k, m, **(knobs or {}))

        def launch(blocks: mx.array) -> tuple[mx.array, np.ndarray]:
            with poisoned_outputs(-7):
                y, token = rmsnorm_gemv_argmax(mx.array(x), mx.array(gamma), 1e-5, repack(blocks, qtype, n, k),
                                               qtype, n, k, scratch, **(knobs or {}))
                mx.eval(y, token)
            return y, np.array(token)

        y, token = launch(dev)
        tied = host.copy()  # the tie: row 0's winner at an earlier and a later row
        win = int(token[0])
        for row in {max(win - 1 - n // 3, 0), min(win + 1 + n // 3, n - 1)} - {win}:
            tied[row] = tied[win]
        y_tied, token_tied = launch(mx.array(tied))
        checks = _against_float64("y", y, rmsnorm64(x, gamma, 1e-5), host, qtype, k, rng)
        for got, logits, which in ((token, y, "tokens"), (token_tied, y_tied, "tokens after a tie")):
            checks.append(exact(which, got, np.argmax(np.array(logits).astype(np.float32), axis=1)))
        row0 = np.array(y_tied)[0]
        checks.append(exact("a tie for row 0's maximum", len(np.flatnonzero(row0 == row0.max())) >= 2 or n == 1, True))
        checks.append(exact("scratch counter left zero", int(np.array(scratch)[0]), 0))
        return checks

    variant = "v3" + ("" if not knobs else " " + ",".join(f"{key}={v}" for key, v in knobs.items()))
    return CheckCase("gemv", f"rmsnorm_gemv_argmax_{qtype}", variant, dict(M=m, N=n, K=k), run)


# The fused head + argmax: the two heads, few threadgroups each streaming many row groups (a
# ragged end), SIMD groups with no rows at all, X' in chunks (one row group a SIMD group, many
# threadgroups), tails of N and K, up to 4 rows.
HEAD_ARGMAX_CASES = [(1, 151936, 1024, None), (1, 128256, 4096, None), (1, 1001, 4096, dict(max_groups=5)),
                     (1, 40, 14336, dict(simds=8)), (2, 4097, 14336, None), (3, 777, 2048, None),
                     (4, 33, 4128, None), (1, 1, 256, None)]


# Launch knobs away from the tuned ones: both weight paths (registers, cp.async slots) and grids
# smaller than the matrix (each SIMD group streaming many row groups, the last ones ragged), on
# aligned and unaligned K; a cap where X takes several chunks is ignored (the real down shape).
KNOB_CASES = [
    ("plain", 1, 1001, 4096, False, dict(slots=0, max_groups=5)),
    ("plain", 1, 1001, 4096, False, dict(slots=2, max_groups=5)),
    ("plain", 2, 1001, 4096, True, dict(slots=3, max_groups=7)),
    ("plain", 1, 333, 4128, False, dict(max_groups=2)),
    ("rmsnorm", 3, 777, 2048, False, dict(slots=2, max_groups=3)),
    ("rmsnorm", 1, 777, 2048, False, dict(slots=0, max_groups=3)),
    ("swiglu", 2, 515, 4096, True, dict(slots=2, max_groups=4)),
    ("swiglu", 1, 4096, 14336, True, dict(slots=2, max_groups=8)),
    # fewer items a SIMD group than slots (all issued at the start), the second tile short
    ("plain", 1, 40, 2304, False, dict(slots=3)),
]


# The same for v3 (gemv_v3.metal): grids smaller than the matrix with ragged ends, R, NSIMD and P
# (loads in flight) away from the tuned ones, passes of a row that end short (P = 16 over a Q8_0
# lane's 28 chunks of K = 14336), and X' in chunks (M = 2 and 4 at K = 14336: a last chunk that
# is short, and a grid cap that must be ignored).
V3_KNOB_CASES = [
    ("plain", 1, 1001, 4096, False, dict(max_groups=5)),
    ("plain", 2, 1001, 4128, True, dict(max_groups=7, depth=1)),
    ("plain", 1, 333, 4096, False, dict(rows=4, simds=2, depth=2)),
    ("rmsnorm", 3, 777, 2048, False, dict(max_groups=3, rows=1)),
    ("swiglu", 2, 4096, 14336, True, dict(max_groups=8)),
    ("swiglu", 4, 515, 14336, True, dict(depth=8)),
    ("plain", 1, 40, 14336, False, dict(depth=16, simds=8)),
]


def _seam_case(qtype: str, swiglu: bool, m: int, n_a: int, k_a: int, n_b: int,
               knobs: dict | None = None, packed: bool = False) -> CheckCase:
    """The seam (kernels.gemv.seam): a_y = residual + X' W_a^T against float64, and b_y against
    float64 RMSNorm of the a_y it wrote (GEMV B reads that fp16 a_y); launched twice on one
    queue, which each launch must leave zero."""
    from kernels.gemv import repack, seam, seam_queue
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        host_a, dev_a = _blocks(rng, qtype, n_a, k_a)
        host_b, dev_b = _blocks(rng, qtype, n_b, n_a)
        if packed:
            dev_a, dev_b = repack(dev_a, qtype, n_a, k_a), repack(dev_b, qtype, n_b, n_a)
        gamma = rng.uniform(0.5, 1.5, n_a).astype(np.float16)
        queue = seam_queue()
        checks = []
        for launch_ in range(2):
            r = (_x(rng, m, n_a).astype(np.float32) * 3 + 1).astype(np.float16)
            x = (_x(rng, m, 2 * k_a if swiglu else k_a).astype(np.float32) * (2 if swiglu else 1)).astype(np.float16)
            with poisoned_outputs():
                a_y, b_y = seam(mx.array(x), dev_a, n_a, k_a, mx.array(r), mx.array(gamma), 1e-5, dev_b, n_b,
                                qtype, swiglu=swiglu, queue=queue, **(knobs or {}))
                mx.eval(a_y, b_y, queue)
            x64 = swiglu64(x) if swiglu else x.astype(np.float64)
            want_a = x64 @ dequantize(host_a, qtype, k_a).astype(np.float64).T + r.astype(np.float64)
            checks.append(compare(f"a_y + residual (launch {launch_})", np.array(a_y).astype(np.float64),
                                  want_a, TOL))
            checks += _against_float64(f"b_y (launch {launch_})", b_y, rmsnorm64(np.array(a_y), gamma, 1e-5),
                                       host_b, qtype, n_a, rng)
            checks.append(exact(f"queue left zero (launch {launch_})", int(np.abs(np.array(queue)).sum()), 0))
        return checks

    variant = "seam " + ("v3 " if packed else "") + ("swiglu" if swiglu else "plain")
    if knobs:
        variant += " " + ",".join(f"{key}={value}" for key, value in knobs.items())
    return CheckCase("gemv", f"seam_{qtype}", variant, dict(M=m, N=f"{n_a}|{n_b}", K=k_a), run)


# Seams of real layers (output projection | gate+up; down | next QKV or the head) and tails, with
# launches of one threadgroup and of far more than fit on the GPU at once (tickets left for none).
SEAM_CASES = [
    (False, 1, 4096, 4096, 28672, None),    # Llama-3-8B O | gate+up
    (True, 1, 4096, 14336, 6144, None),     # Llama-3-8B down (X in chunks) | QKV
    (True, 1, 4096, 11008, 12288, None),    # Llama-2-7B down | QKV
    (True, 1, 4096, 11008, 32000, None),    # Llama-2-7B down | output head
    (False, 1, 1024, 2048, 6144, None),     # Qwen3-0.6B O | gate+up
    (True, 2, 1024, 3072, 4096, None),      # Qwen3-0.6B down | QKV, two rows
    (False, 3, 4128, 96, 33, None),         # tails: unaligned rows, N_b smaller than a group
    (True, 4, 160, 4128, 4097, None),
    (False, 1, 4096, 4096, 32, dict(rows=2, simds=8, launched=2)),  # 2 threadgroups take A's 256
    (True, 1, 1024, 3072, 4096, dict(launched=4000)),
    (False, 2, 1001 // 32 * 32, 4096, 1001, dict(max_groups=5, slots=2)),
    # B's first weights before the wait or after it, against the defaults (slots: after)
    (True, 1, 4096, 11008, 12288, dict(prefetch=0)),
    (False, 1, 4096, 4096, 22016, dict(prefetch=1)),
    (False, 1, 4096, 4096, 32, dict(rows=2, simds=8, launched=2, prefetch=1)),
]


def _projection_case(qtype: str, sizes: tuple[int, ...], k: int, m: int, packed: bool = False) -> CheckCase:
    """A fused projection (QKV, gate+up): one matrix from the parts (`packed`: then repacked, as
    the decoder does), one product, split."""
    from kernels.gemv import concat_rows, linear, repack, split
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        parts = [_blocks(rng, qtype, n, k) for n in sizes]
        x = _x(rng, m, k)
        w = concat_rows([d for _, d in parts])
        if packed:
            w = repack(w, qtype, sum(sizes), k)
        with poisoned_outputs():
            ys = split(linear(mx.array(x), w, qtype, sum(sizes), k), sizes)
            mx.eval(ys)
        checks = []
        for i, ((host, _), y) in enumerate(zip(parts, ys)):
            checks += _against_float64(f"part {i}", y, x.astype(np.float64), host, qtype, k, rng)
        return checks

    name = "qkv" if len(sizes) == 3 else "gate_up"
    return CheckCase("gemv", f"{name}_{qtype}", "fused projection" + (" v3" if packed else ""),
                     dict(M=m, N="+".join(map(str, sizes)), K=k), run)


def _pair_case(qtype: str, qtype_b: str, m: int, n: int, n_b: int, k: int, norm: bool,
               knobs: dict | None = None) -> CheckCase:
    """v3's pair (kernels.gemv's w_b): two repacked matrices of their own block types in one
    launch, Y = [X' W^T | X' W_B^T], each half against float64; X' = RMSNorm(X) * gamma or X.
    The fused loop's QKV where a layer's attn_v is of another type than attn_q and attn_k."""
    from kernels.gemv import gemv_v3, repack, rmsnorm_gemv
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        (host, dev), (host_b, dev_b) = _blocks(rng, qtype, n, k), _blocks(rng, qtype_b, n_b, k)
        w, w_b = repack(dev, qtype, n, k), repack(dev_b, qtype_b, n_b, k)
        x = (_x(rng, m, k).astype(np.float32) * 3 + 1).astype(np.float16)
        gamma = rng.uniform(0.5, 1.5, k).astype(np.float16)
        with poisoned_outputs():
            if norm:
                y = rmsnorm_gemv(mx.array(x), mx.array(gamma), 1e-5, w, qtype, n, k, w_b=w_b, **(knobs or {}))
            else:
                y = gemv_v3(mx.array(x), w, qtype, n, k, w_b=w_b, **(knobs or {}))
            mx.eval(y)
        x64 = rmsnorm64(x, gamma, 1e-5) if norm else x.astype(np.float64)
        checks = [exact("y is [M, N + N_B]", tuple(y.shape), (m, n + n_b))]
        checks += _against_float64(f"y[:, :{n}] ({qtype})", y[:, :n], x64, host, qtype, k, rng)
        checks += _against_float64(f"y[:, {n}:] ({qtype_b})", y[:, n:], x64, host_b, qtype_b, k, rng)
        return checks

    variant = "v3 pair" + (" rmsnorm" if norm else "")
    if knobs:
        variant += " " + ",".join(f"{key}={value}" for key, value in knobs.items())
    return CheckCase("gemv", f"gemv_pair_{qtype}_{qtype_b}", variant, dict(M=m, N=f"{n}|{n_b}", K=k), run)


# Pairs (w_b): the 8B Q4_K_M QKV ([q; k] Q4_K, v Q6_K), Qwen3-0.6B's (Q5_K_M: K = 1024) at M 2,
# tails of both matrices at M 3 and 4, Q4_0 beside a K-quant, Q8_0 beside Q8_0, and W's grid
# capped (its row groups streamed) with a B of one row.
PAIR_CASES = [
    ("q4_k", "q6_k", 1, 5120, 1024, 4096, True, None),
    ("q5_k", "q6_k", 2, 3072, 1024, 1024, True, None),
    ("q6_k", "q4_k", 3, 33, 7, 768, False, None),
    ("q4_k", "q5_k", 4, 7, 4097, 256, True, None),
    ("q4_0", "q6_k", 1, 1001, 33, 4352, False, None),
    ("q8_0", "q8_0", 2, 4096, 1024, 4128, True, None),
    ("q4_k", "q6_k", 1, 1001, 1, 4096, True, dict(max_groups=5, rows=2)),
    # a Q8_0 GEMV over X' in 32-value chunks and 32-value GEMVs over Q8_0's 16 (Gemma 3's Q4_K_M:
    # [q; k] Q5_0, attn_v Q8_0), the last with X' in chunks
    ("q5_0", "q8_0", 1, 1280, 256, 640, True, None),
    ("q8_0", "q4_k", 2, 512, 100, 1024, True, None),
    ("q4_0", "q8_0", 2, 1001, 64, 14336, False, None),
]


def _gate_up_swiglu_case(qtype: str, m: int, f: int, k: int, norm: bool, knobs: dict | None = None,
                         gemma: bool = False) -> CheckCase:
    """gate+up with SwiGLU in its epilogue (kernels.gemv.gate_up_swiglu) on [gate; up] repacked as
    the decoder repacks it: silu(X' Wg^T) * (X' Wu^T) against float64, X' = RMSNorm(X) * gamma or X.
    `gemma` (with norm): GELU, and X float32 of magnitudes past fp16's."""
    from kernels.gemv import concat_rows, gate_up_swiglu, repack
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        (g_host, g_dev), (u_host, u_dev) = _blocks(rng, qtype, f, k), _blocks(rng, qtype, f, k)
        w = repack(concat_rows([g_dev, u_dev]), qtype, 2 * f, k)
        x = (_x(rng, m, k).astype(np.float32) * 3 + 1)
        x = x * 3e4 if gemma else x.astype(np.float16)
        gamma = rng.uniform(0.5, 1.5, k).astype(np.float16)
        norm_args = dict(gamma=mx.array(gamma), eps=1e-5) if norm else {}
        act = "gelu" if gemma else "silu"
        with poisoned_outputs():
            y = gate_up_swiglu(mx.array(x), w, qtype, 2 * f, k, activation=act, **norm_args, **(knobs or {}))
            mx.eval(y)
        x64 = rmsnorm64(x, gamma, 1e-5) if norm else x.astype(np.float64)
        rows = _rows_checked(rng, f)
        gate = x64 @ dequantize(g_host[rows], qtype, k).astype(np.float64).T
        up = x64 @ dequantize(u_host[rows], qtype, k).astype(np.float64).T
        want = ref_loop.swiglu(np.concatenate([gate, up], axis=1), act)
        return [compare(f"{act}(gate) * up", np.array(y).astype(np.float64)[:, rows], want, TOL)]

    variant = "v3" + (" rmsnorm" if norm else "") + (" gemma (float32 X, GELU)" if gemma else "")
    if knobs:
        variant += " " + ",".join(f"{key}={value}" for key, value in knobs.items())
    return CheckCase("gemv", f"gate_up_swiglu_{qtype}", variant, dict(M=m, N=f"{f}+{f}", K=k), run)


# SwiGLU out: the Llama and Qwen3 FFN shapes, tails (one output; 33 with K = 4128), R halved to a
# pair on a tiny matrix, R = 4 (two outputs a SIMD group), grids capped (streaming, ragged) and P.
GATE_UP_SWIGLU_CASES = [
    (1, 14336, 4096, True, None), (2, 14336, 4096, True, None), (1, 3072, 1024, True, None),
    (1, 11008, 4096, False, None), (3, 33, 4128, True, None), (4, 1, 32, False, None),
    (1, 1001, 4096, True, dict(rows=4, max_groups=5)), (2, 777, 2048, False, dict(max_groups=3, depth=1)),
]


def check_cases(small: bool = False) -> list[CheckCase]:
    """Every GEMV form and format the family holds (`small`: the odd shapes only, one of each kind,
    for `lathe compile`)."""
    cases = []
    odd = [(n, k) for n in SMALL_N for k in SMALL_K]
    for qtype in K_QTYPES:  # the K-quants: their formats on the GPU and the v3 GEMVs
        shapes = [(1, 256), (7, 768), (33, 4352)] + ([] if small else [(1024, 3072), (4096, 14336)])
        cases += [_dequantize_k_case(qtype, n, k) for n, k in shapes]
        cases += _v3_cases(qtype, small)
    for qtype in ("q5_0", "q8_0", "q4_k", "q6_k"):  # Gemma-3-270M's types in Gemma's forms
        cases += [_fused_case("rmsnorm", qtype, m, *((33, 256) if m > 1 else (1024, 768)), version="v3", gemma=True)
                  for m in (1, 3)]
        cases.append(_fused_case("swiglu", qtype, 1, 640, 2048, residual=True, version="v3", gemma=True))
        cases.append(_gate_up_swiglu_case(qtype, 1, 2048, 768, True, gemma=True))
    for qtype in LEGACY_QTYPES:  # the legacy affine blocks: v3's small set, and real shapes
        cases += [_dequantize_k_case(qtype, n, k) for n, k in [(1, 32), (7, 96), (33, 4128)]
                  + ([] if small else [(1024, 640)])]
        cases += _v3_cases(qtype, True)
        cases += [_gemv_case("v3", qtype, 1 + c % 2, n, k) for c, (n, k) in enumerate(() if small else LEGACY_REAL)]
    for qtype in IQ4_QTYPES:  # the IQ4s: the same, IQ4_XS in whole super-blocks
        xs = qtype == "iq4_xs"
        shapes = [(1, 256), (7, 768), (33, 4352)] if xs else [(1, 32), (7, 96), (33, 4128)]
        cases += [_dequantize_k_case(qtype, n, k) for n, k in shapes + ([] if small else [(1024, 4096)])]
        cases += _v3_cases(qtype, True)
        cases += [_gemv_case("v3", qtype, 1 + c % 2, n, k) for c, (n, k) in
                  enumerate(() if small else [s for s in LEGACY_REAL if not xs or s[1] % 256 == 0])]
    for qtype in QTYPES:
        cases += [_quantize_case(qtype, 33, 4128), _quantize_case(qtype, 1, 32),
                  _quantize_case(qtype, 0, 256, adversarial=True)]
        real = [] if small else [*REAL, *VOCAB]
        for c, (n, k) in enumerate(odd + real):
            cases.append(_gemv_case("v2", qtype, 1 + c % 4, n, k))
        for c, (n, k) in enumerate(odd if small else odd + list(REAL)):
            cases.append(_gemv_case("v1", qtype, 1 + c % 4, n, k))
        if not small:
            cases += [_gemv_case("v2", qtype, m, 4096, 4096) for m in (1, 2, 3)]
            cases.append(_quantize_case(qtype, 4096, 4096))
        for m in (1, 2, 3, 4):  # real shapes at M 1 and 2, tails at M 3 and 4
            tail = small or m > 2
            cases.append(_fused_case("rmsnorm", qtype, m, *((33, 4128) if tail else (4096, 4096))))
            cases.append(_fused_case("swiglu", qtype, m, *((33, 4128) if tail else (4096, 14336))))
            cases.append(_fused_case("swiglu", qtype, m, *((33, 4128) if tail else (4096, 14336)),
                                     residual=True))
            cases.append(_fused_case("plain", qtype, m, *((33, 4128) if tail else (4096, 4096)),
                                     residual=True))
        for kind, m, n, k, residual, knobs in KNOB_CASES[:2] if small else KNOB_CASES:
            cases.append(_fused_case(kind, qtype, m, n, k, residual, knobs))
        for m in (5, 16) if small else (5, 9, 16, 512):
            for n, k in ((4097, 4128), (4096, 4096)) if not small else ((33, 96),):
                cases.append(_gemv_case("linear", qtype, m, n, k))
        for swiglu, m, n_a, k_a, n_b, knobs in SEAM_CASES[6:8] if small else SEAM_CASES:
            cases.append(_seam_case(qtype, swiglu, m, n_a, k_a, n_b, knobs))
        if not small:
            cases.append(_projection_case(qtype, (4096, 1024, 1024), 4096, 1))
            cases.append(_projection_case(qtype, (14336, 14336), 4096, 2))
        cases += _v3_cases(qtype, small)
    cases += [_pair_case(*case) for case in (PAIR_CASES[2:4] if small else PAIR_CASES)]
    return cases


# v3 seams: the real layers' and tails (SEAM_CASES' shapes), launches of few threadgroups and of
# far more than fit, B's first weights before the wait or after it, X' in chunks (M = 2, K = 14336).
V3_SEAM_CASES = [*[case[:5] + (None,) for case in SEAM_CASES[:8]],
                 (True, 2, 4096, 14336, 6144, None),
                 (False, 1, 4096, 4096, 32, dict(rows=2, simds=8, launched=2)),
                 (True, 1, 1024, 3072, 4096, dict(launched=4000)),
                 (True, 1, 4096, 11008, 12288, dict(prefetch=0)),
                 (False, 1, 4096, 4096, 22016, dict(prefetch=1, depth=2))]


# The quantized GEMM (qmm) for 5..64 rows: tails of N (not whole blocks of 8 rows) and of K (not
# whole super-chunks of 128: 4128 leaves a last super-chunk of one chunk, which WK groups share
# unevenly), long K (4096 x 14336), and each knob at its edges.
QMM_CASES = [(5, 33, 96, False, None), (16, 33, 96, True, None),
             (5, 4097, 4128, False, None), (16, 4097, 4128, True, None), (33, 4097, 4128, False, None),
             (64, 4097, 4128, True, None), (16, 4096, 14336, False, None), (64, 1024, 4096, False, None),
             (16, 4096, 4096, False, dict(nb=1, wn=1, wk=1)), (33, 4096, 4096, True, dict(nb=4, wn=2, wk=2)),
             (64, 2048, 4096, False, dict(nb=1, wn=4, wk=4)),
             # K split over threadgroups (ks; a second launch adds the parts): parts of unequal
             # length, a tail of N and K, the residual in the adding launch, 64 rows on 14336
             (16, 4097, 4128, True, dict(ks=4)), (9, 1000, 1024, False, dict(ks=3)),
             (33, 4097, 4128, False, dict(ks=2, nb=4, wn=2, wk=2)), (64, 4096, 14336, True, dict(ks=8)),
             # the next super-chunk's weights loaded ahead (pf): past the end of K, and of a part of K
             (16, 4097, 4128, False, dict(pf=1, wk=2)), (33, 4097, 4128, True, dict(pf=1, ks=3, nb=4, wn=2, wk=1)),
             # 8 row blocks a SIMD group (the sweep's widest): tails of N and K, split K
             (16, 4097, 4128, True, dict(nb=8, wn=1, wk=2)), (5, 1000, 1024, False, dict(nb=8, wn=2, wk=1)),
             (16, 4096, 14336, False, dict(nb=8, wn=1, wk=2, ks=4)),
             # X staged for the threadgroup (xs buffers): tails of M (rows copied from the last),
             # of N and K (a last round of one chunk, past it zeros), WK groups in a round, split
             # K (rounds of a part), 64 rows in 2 buffers, the weights ahead as well
             (5, 4097, 4128, False, dict(xs=2, nb=2, wn=8, wk=1)),
             (16, 4097, 4128, True, dict(xs=3, nb=4, wn=8, wk=1)),
             (20, 1000, 4128, False, dict(xs=2, nb=2, wn=4, wk=2)),
             (16, 4096, 14336, True, dict(xs=4, nb=4, wn=4, wk=1, ks=3)),
             (64, 4097, 4096, False, dict(xs=2, nb=2, wn=8, wk=1)), (9, 33, 96, True, dict(xs=2, nb=1, wn=2, wk=4)),
             (16, 4097, 4128, False, dict(xs=2, pf=1, nb=4, wn=8, wk=1)),
             # W's loads evict-first (wst), unstaged and staged
             (33, 4097, 4128, True, dict(wst=1)), (16, 4096, 4096, False, dict(wst=1, xs=2, nb=4, wn=8, wk=1)),
             # the rule's staged down projection past 32 rows (qmm_x_staged auto): 8 SIMD groups, 4 parts
             (64, 4096, 14336, True, None),
             # W through a ring on X's rounds (wr; Q4_0 and Q8_0, the other types as without it): tails
             # of N, K and M, WK groups in a round, split K, 3 buffers, a whole 4096 x 14336; the third
             # fits Metal's 32 KiB (the small set's, which `lathe compile --metal` reads)
             (16, 4097, 4128, False, dict(xs=2, wr=1, nb=4, wn=4, wk=1)),
             (20, 1000, 4128, True, dict(xs=2, wr=1, nb=2, wn=4, wk=1, ks=2)),
             (5, 33, 96, False, dict(xs=2, wr=1, nb=1, wn=4, wk=1)),
             (16, 4096, 14336, True, dict(xs=2, wr=1, nb=2, wn=8, wk=1, ks=4)),
             # the rule's down with its residual at 32 rows (Q4_0, Q8_0: W's ring, 4 parts)
             (32, 4096, 14336, True, None),
             # the rule's split from K = 2048 (Qwen3's down and O with their residual)
             (32, 1024, 3072, True, None), (64, 1024, 2048, True, None)]
# qmm on the warp MMA (qmm_mma.cu, Hopper only; Q4_0, Q8_0): tails of N (not whole 16-row tiles)
# and of M (not whole 8-row tiles, one row), of K (9 groups: a last stage of one), parts of K with
# no stage (8 parts of 6), each knob at its edges within the shared memory, the 8B's shapes at 16
# and 64 rows, the residual in the launch and in the adding one.
QMM_MMA_CASES = [(1, 33, 128, False, None), (5, 4097, 4096, True, None), (16, 4096, 4096, False, None),
                 (16, 28672, 4096, False, None), (16, 4096, 14336, True, None), (33, 1000, 1024, False, None),
                 (64, 6144, 4096, True, None), (64, 4096, 14336, False, None),
                 (16, 4097, 4096, False, dict(tm=4, nw=2, ks=1)), (9, 1000, 3072, True, dict(tm=1, nw=4, ks=8)),
                 (64, 1024, 2048, True, dict(tm=2, nw=2, ks=3, stages=2, sg=2)),
                 (40, 4096, 1152, True, dict(tm=1, nw=8, ks=1, sg=2)),
                 (24, 2056, 4096, False, dict(tm=1, nw=16, ks=2, stages=2, sg=2)),
                 (16, 4097, 1152, False, dict(stages=2, sg=8, ks=1, nw=2)), (5, 1000, 1152, True, dict(stages=4, sg=1, ks=1)),
                 (33, 4096, 4096, False, dict(stages=2, sg=2, tm=2, nw=4)),
                 # W's rows asked of the L2 in runs: past the part's end (split K), a partial last
                 # stage, rows past N, 64 rows
                 (16, 4097, 4096, False, dict(tm=2, nw=4, ks=1, pf=4)), (33, 1000, 1152, True, dict(stages=3, sg=1, pf=2)),
                 (64, 4096, 14336, True, dict(ks=3, pf=8)), (16, 28672, 4096, False, dict(tm=2, nw=4, ks=1, pf=16)),
                 # K warps: a stage's groups shared by 2 or 4 warps of the same rows, their sums added in the
                 # CTA; a last stage whose groups leave a K warp none (9 groups of stages of 4: one, then
                 # 5 of 2 a warp, one of 4), split K, 64 rows, tails of N and M
                 (16, 28672, 4096, False, dict(tm=2, nw=8, kw=2, ks=1, sg=1)),
                 (16, 4097, 1152, True, dict(tm=1, nw=8, kw=4, ks=1, stages=2, sg=1)),
                 (5, 1000, 1152, False, dict(tm=1, nw=4, kw=2, ks=1, stages=3, sg=2)),
                 (33, 4096, 14336, True, dict(tm=2, nw=8, kw=2, ks=4, stages=2, sg=2)),
                 (64, 6144, 4096, False, dict(tm=2, nw=8, kw=4, ks=1, stages=2, sg=1))]
# ... and gated (silu(gate) * up of [gate; up], F not a whole tile; in the launch and the adding one)
QMM_MMA_GATED_CASES = [(16, 2 * 14336, 4096, None), (5, 2 * 1001, 1024, None), (64, 2 * 3072, 1024, None),
                       (20, 2 * 4096, 4096, dict(tm=4, nw=2, ks=1)), (1, 2 * 24, 256, dict(tm=2, nw=1, ks=2)),
                       (16, 2 * 1001, 4096, dict(tm=2, nw=4, ks=4)), (16, 2 * 1001, 4096, dict(tm=2, nw=4, ks=2, pf=4)),
                       (16, 2 * 14336, 4096, dict(tm=2, nw=8, kw=2, ks=1, sg=1)),
                       (9, 2 * 1001, 1152, dict(tm=2, nw=4, kw=4, ks=2, stages=2, sg=1))]
# ... and on RowBlocks (ROWS8: a stage's pieces of a row block one run): the rule's gate+up, down (split
# K) and a tail of M and of 16-row tiles (N whole row blocks), a partial last stage of 8 groups, 8 parts,
# 4 tiles a warp, K warps (alone and with split K)
QMM_MMA_ROWS8_CASES = [(16, 28672, 4096, False, None), (5, 4104, 4096, True, None), (64, 4096, 14336, True, None),
                       (16, 1000, 1152, False, dict(stages=2, sg=8, ks=1, nw=2)),
                       (9, 1000, 3072, True, dict(tm=1, nw=4, ks=8)), (16, 4096, 4096, False, dict(tm=4, nw=2, ks=1)),
                       (16, 28672, 4096, False, dict(tm=2, nw=8, kw=2, ks=1, sg=1)),
                       (33, 4096, 14336, True, dict(tm=2, nw=8, kw=2, ks=4, stages=2, sg=2))]
QMM_MMA_ROWS8_GATED_CASES = [(16, 2 * 14336, 4096, None), (5, 2 * 1000, 1024, None),
                             (16, 2 * 1000, 4096, dict(tm=2, nw=4, ks=4)),
                             (16, 2 * 14336, 4096, dict(tm=2, nw=8, kw=2, ks=1, sg=1))]
# ... and stream-K (sk CTAs, each an equal run of (tile, stage) units; the last CTA of a tile adds its
# parts): the 8B's gate+up over 2 CTAs an SM (a tile in 1-2 parts), down with its residual (a tile in
# 8-9 parts, CTAs inside one tile), tails of M and N, more than 32 rows with a partial last stage, K
# warps, one unit a CTA, gated in parts
QMM_MMA_SK_CASES = [(16, 28672, 4096, False, dict(tm=2, nw=4, ks=1, sk=264)),
                    (16, 4096, 14336, True, dict(tm=2, nw=4, ks=1, sk=264)),
                    (5, 4097, 4096, True, dict(tm=1, nw=4, ks=1, sk=133)),
                    (33, 1000, 1152, False, dict(tm=1, nw=4, ks=1, stages=3, sg=2, sk=7)),
                    (16, 4096, 4096, False, dict(tm=1, nw=8, kw=4, ks=1, sg=2, sk=100)),
                    (9, 1000, 1024, True, dict(tm=1, nw=4, ks=1, sg=2, sk=64))]
QMM_MMA_SK_GATED_CASES = [(16, 2 * 14336, 4096, dict(tm=2, nw=4, ks=1, sk=264)),
                          (5, 2 * 1001, 1024, dict(tm=2, nw=4, ks=1, sk=50))]
# W's ring on its own schedule (wr 1..4 without xs; Q4_0 and Q8_0, the other types as without it):
# tails of N, K and M, WK groups, split K (a part of 11 super-chunks with 4 ahead: copies past the
# part), 64 rows; each fits Q8_0's two words a chunk in 48 KiB, the first Metal's 32 KiB
QMM_DEPTH_CASES = [(5, 33, 96, False, dict(wr=2, nb=1, wn=4, wk=1)),
                   (16, 4097, 4128, True, dict(wr=3, nb=2, wn=2, wk=2)),
                   (33, 1000, 4128, False, dict(wr=4, nb=1, wn=2, wk=2, ks=3)),
                   (16, 4096, 14336, True, dict(wr=2, nb=2, wn=4, wk=1, ks=4)),
                   (64, 4097, 4096, False, dict(wr=1, nb=2, wn=2, wk=2))]
# W as RowBlocks (Q4_0, Q8_0: N whole row blocks of 8, K whole super-chunks): the rule's launches
# at 5-64 rows (unstaged, staged with W's ring, staged with PF), a gate+up's tail of row blocks
# in a threadgroup, split K, and the staged knobs given; the first fits Metal's small set
QMM_ROWS8_CASES = [(5, 1000, 4096, False, dict(nb=2, wn=2, wk=2, ks=2)), (16, 4096, 4096, True, None),
                   (32, 4096, 14336, True, None), (64, 4104, 4096, False, None), (33, 28672, 4096, True, None),
                   (16, 1000, 4224, True, dict(xs=2, wr=1, nb=4, wn=4, wk=1)),
                   (20, 1000, 4224, False, dict(xs=2, pf=1, nb=2, wn=8, wk=1, ks=3)),
                   # W's ring on its own schedule, 2 and 4 ahead
                   (16, 28672, 4096, False, dict(wr=2, nb=2, wn=2, wk=2)),
                   (32, 1000, 4224, True, dict(wr=4, nb=1, wn=2, wk=2, ks=2))]
QMM_ROWS8_FUSED_CASES = [("rmsnorm+gated", "silu", 16, 2 * 14336, 4096, None),
                         ("rmsnorm+gated", "silu", 64, 2 * 1000, 4096, None),
                         ("rmsnorm+gated", "silu", 16, 2 * 1000, 4224, dict(xs=2, wr=1, nb=4, wn=4, wk=1))]


# qmm fused as the GEMVs are: the RMSNorm prologue, the gated epilogue (act(gate) * up of a
# [gate; up] matrix: n = 2F rows, F not a whole row block, GELU for Gemma), both (a prompt's FFN
# step), and knobs away from the defaults (gated: NB even).
QMM_FUSED_CASES = [("rmsnorm", None, 5, 33, 96, None), ("rmsnorm+gated", "silu", 16, 2 * 1001, 1024, None),
                   ("rmsnorm", None, 16, 4097, 4128, None), ("rmsnorm", None, 64, 1024, 3072, None),
                   ("gated", "silu", 33, 2 * 3072, 1024, None), ("gated", "gelu", 16, 2 * 515, 2048, None),
                   ("rmsnorm+gated", "silu", 20, 2 * 4096, 4096, None),
                   ("rmsnorm+gated", "silu", 9, 2 * 1000, 2048, dict(nb=2, wn=1, wk=2)),
                   # split K: the prologue over all of K in each part, the gated epilogue after the sum
                   ("rmsnorm+gated", "silu", 20, 2 * 1001, 4128, dict(ks=3)),
                   ("rmsnorm", None, 16, 4097, 4128, dict(ks=4)), ("gated", "gelu", 16, 2 * 515, 2048, dict(ks=2)),
                   ("rmsnorm+gated", "silu", 20, 2 * 1001, 4128, dict(pf=1, ks=2)),
                   # the prologue and the gated epilogue over staged X
                   ("rmsnorm+gated", "silu", 16, 2 * 1001, 4128, dict(xs=2, nb=2, wn=8, wk=1)),
                   ("rmsnorm", None, 33, 4097, 4128, dict(xs=3, nb=4, wn=4, wk=1, ks=2)),
                   # the rule's staged gate+up (qmm_x_staged auto), unsplit: past 32 rows W a super-chunk
                   # ahead (Q4_0, Q8_0), at 32 rows W through the ring (the K-quants unstaged); the QKV's
                   # 6144 x 4096 past 32 rows (Q4_0, Q8_0 staged, 4 parts)
                   ("rmsnorm+gated", "silu", 64, 2 * 14336, 4096, None),
                   ("rmsnorm+gated", "silu", 32, 2 * 14336, 4096, None),
                   ("rmsnorm", None, 64, 6144, 4096, None),
                   # W's ring under the prologue and the gated epilogue
                   ("rmsnorm+gated", "silu", 16, 2 * 1001, 4128, dict(xs=2, wr=1, nb=4, wn=4, wk=1))]


def _qmm_fused_case(kind: str, act: str | None, qtype: str, m: int, n: int, k: int, knobs: dict | None,
                    rows8: bool = False, mma: bool = False) -> CheckCase:
    """qmm with the RMSNorm prologue and/or the gated epilogue against float64: RMSNorm(X) * gamma
    of fp16 X, then X @ W^T, then act(gate) * up of its halves (`rows8`: W as RowBlocks; `mma`:
    qmm_mma, the gated form only)."""
    from kernels.gemv import interleave_rows, qmm, qmm_mma, repack
    from kernels.runtime import poisoned_outputs

    norm = kind.startswith("rmsnorm")

    def run(rng: np.random.Generator) -> list[Comparison]:
        host, dev = _blocks(rng, qtype, n, k)
        x = (_x(rng, m, k).astype(np.float32) * 3 + 1).astype(np.float16)
        gamma = rng.uniform(0.5, 1.5, k).astype(np.float16)
        extra = dict(gamma=mx.array(gamma), eps=1e-5) if norm else {}
        with poisoned_outputs():
            w = repack(dev, qtype, n, k)
            y = (qmm_mma if mma else qmm)(mx.array(x), interleave_rows(w) if rows8 else w, qtype, n, k,
                                          activation=act, **extra, **(knobs or {}))
            mx.eval(y)
        x64 = rmsnorm64(x, gamma, 1e-5) if norm else x.astype(np.float64)
        if act is None:
            return _against_float64("y", y, x64, host, qtype, k, rng)
        want = ref_loop.swiglu(x64 @ dequantize(host, qtype, k).astype(np.float64).T, act)
        return [compare(f"{act}(gate) * up", np.array(y).astype(np.float64), want, TOL)]

    variant = ("mma " if mma else "") + kind + (f" ({act})" if act else "") + (" rows8" if rows8 else "") + \
        ("".join(f" {key}={v}" for key, v in (knobs or {}).items()))
    return CheckCase("gemv", f"qmm_{qtype}", variant, dict(M=m, N=n, K=k), run)


def _qmm_mma_sk_again_case(qtype: str) -> CheckCase:
    """Stream-K's counters: two launches on one counters array give the same bits (each leaves them
    zero, checked), and against float64; a tile in up to 9 parts."""
    from kernels.gemv import qmm_mma, repack
    from kernels.runtime import poisoned_outputs

    m, n, k, knobs = 16, 4096, 14336, dict(tm=2, nw=4, ks=1, sk=264)

    def run(rng: np.random.Generator) -> list[Comparison]:
        host, dev = _blocks(rng, qtype, n, k)
        x = _x(rng, m, k)
        counters = mx.zeros((32,), mx.uint32)
        with poisoned_outputs():
            w = repack(dev, qtype, n, k)
            first = qmm_mma(mx.array(x), w, qtype, n, k, counters=counters, **knobs)
            mx.eval(first, counters)
            left = np.array(counters)
            again = qmm_mma(mx.array(x), w, qtype, n, k, counters=counters, **knobs)
            mx.eval(again)
        return _against_float64("y", first, x.astype(np.float64), host, qtype, k, rng) + [
            exact("counters left zero", left, np.zeros(32, np.uint32)),
            exact("second launch, same bits", np.array(again).view(np.uint16), np.array(first).view(np.uint16))]

    return CheckCase("gemv", f"qmm_{qtype}", "qmm mma sk again", dict(M=m, N=n, K=k, SK=264), run)


# qmm's residual epilogue writing the next block's RMSNorm as well (next_norm): K in one part (the
# adding launch after an unsplit qmm), split by the rule (the 8B's O and down at 8, 16 and 64 rows,
# Qwen3's down) and by hand (tails of K), rows of fewer words than the threadgroup's threads and of
# more, W's ring over staged X (16 rows: Q8_0's ring does not fit 48 KiB at 32)
QMM_NORM_OUT_CASES = [(5, 32, 96, None), (20, 4104, 4128, dict(ks=1)), (9, 1024, 1024, dict(ks=2)),
                      (8, 4096, 4096, None), (16, 4096, 14336, None), (64, 4096, 14336, None),
                      (9, 1024, 3072, None), (33, 1000, 4128, dict(ks=3)),
                      (16, 4096, 4096, dict(xs=2, wr=1, nb=4, wn=4, wk=1))]


def _qmm_norm_out_case(qtype: str, m: int, n: int, k: int, knobs: dict | None) -> CheckCase:
    """qmm + residual with next_norm: Y against float64, and H against kernels.loop's rmsnorm
    launch on that Y, bit for bit where the adding launch has rmsnorm's layout (N up to 1024),
    else within an fp16 step (its sums in another order), and against float64."""
    from kernels import gemv, loop
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        host, dev = _blocks(rng, qtype, n, k)
        x, r = _x(rng, m, k), _x(rng, m, n)
        gamma = rng.uniform(0.5, 1.5, n).astype(np.float16)
        with poisoned_outputs():
            y, h = gemv.qmm(mx.array(x), gemv.repack(dev, qtype, n, k), qtype, n, k, residual=mx.array(r),
                            next_norm=(mx.array(gamma), 1e-5), **(knobs or {}))
            mx.eval(y, h)
            launched = loop.rmsnorm(y, mx.array(gamma), 1e-5)
            mx.eval(launched)
        want = x.astype(np.float64) @ dequantize(host, qtype, k).astype(np.float64).T + r.astype(np.float64)
        y64 = np.array(y).astype(np.float64)
        same_layout = gemv.qmm_reduce_nsimd(n) == loop.NSIMD
        return [compare("y + residual", y64, want, TOL),
                exact("h: rmsnorm's launch on y", np.array(h), np.array(launched)) if same_layout else
                within_fp16_steps("h: rmsnorm's launch on y", np.array(h), np.array(launched).astype(np.float32)),
                compare("h", np.array(h).astype(np.float64), rmsnorm64(y64, gamma, 1e-5), TOL)]

    shape = dict(M=m, N=n, K=k, **{key.upper(): v for key, v in (knobs or {}).items()})
    return CheckCase("gemv", f"qmm_{qtype}", "residual + next_norm", shape, run)


# qmm's split K added in the launch (counters given, qmm_combine last_group): tails of N, M and K
# in parts of unequal length, the residual, the RMSNorm prologue and the gated epilogue (SiLU,
# GELU), staged X, the rule's split of Qwen3's O and down at 8 rows, the 8B's down at 64 rows
QMM_LAST_CASES = [("plain", None, 16, 4097, 4128, False, dict(ks=4)), ("plain", None, 9, 1000, 1024, True, dict(ks=3)),
                  ("rmsnorm+gated", "silu", 20, 2 * 1001, 4128, False, dict(ks=3)),
                  ("gated", "gelu", 16, 2 * 515, 2048, False, dict(ks=2)),
                  ("rmsnorm", None, 33, 4097, 4128, False, dict(xs=3, nb=4, wn=4, wk=1, ks=2)),
                  ("plain", None, 8, 1024, 2048, True, None), ("plain", None, 8, 1024, 3072, True, None),
                  ("plain", None, 64, 4096, 14336, True, dict(ks=8))]


def _qmm_last_case(kind: str, act: str | None, qtype: str, m: int, n: int, k: int, residual: bool,
                   knobs: dict | None) -> CheckCase:
    """qmm's parts added by each row block's last threadgroup: Y against float64 and, bit for bit,
    against the adding launch's (the same sums in the same order); a second call on the same
    counters (after the first: each launch leaves them zero) gives the same Y; the counters end zero."""
    from kernels import options
    from kernels.gemv import qmm, qmm_counters, repack
    from kernels.runtime import poisoned_outputs

    norm = kind.startswith("rmsnorm")

    def run(rng: np.random.Generator) -> list[Comparison]:
        host, dev = _blocks(rng, qtype, n, k)
        x = (_x(rng, m, k).astype(np.float32) * 3 + 1).astype(np.float16)
        n_out = n // 2 if act else n
        r = _x(rng, m, n_out) if residual else None
        gamma = rng.uniform(0.5, 1.5, k).astype(np.float16)
        extra = dict(gamma=mx.array(gamma), eps=1e-5) if norm else {}
        if residual:
            extra["residual"] = mx.array(r)
        counters = qmm_counters(n)
        with poisoned_outputs():
            w = repack(dev, qtype, n, k)
            ys = []
            for combine in ("last_group", "last_group", "launch"):
                with options.use(qmm_combine=combine):
                    ys.append(qmm(mx.array(x), w, qtype, n, k, activation=act, counters=counters, **extra,
                                  **(knobs or {})))
                mx.eval(ys[-1])  # launches on one set of counters, one after another
        x64 = rmsnorm64(x, gamma, 1e-5) if norm else x.astype(np.float64)
        y64 = x64 @ dequantize(host, qtype, k).astype(np.float64).T
        want = ref_loop.swiglu(y64, act) if act else y64 + (r.astype(np.float64) if residual else 0.0)
        return [compare("y (last group)", np.array(ys[0]).astype(np.float64), want, TOL),
                exact("y: the adding launch's", np.array(ys[0]), np.array(ys[2])),
                exact("y: again on the same counters", np.array(ys[1]), np.array(ys[0])),
                exact("counters left zero", np.array(counters), np.zeros(counters.size, np.uint32))]

    variant = "last group " + kind + (f" ({act})" if act else "") + (" + residual" if residual else "")
    shape = dict(M=m, N=n, K=k, **{key.upper(): v for key, v in (knobs or {}).items()})
    return CheckCase("gemv", f"qmm_{qtype}", variant, shape, run)


def _k_shape(k: int) -> int:
    """A check shape's K for the K-quants: rounded up to whole super-blocks."""
    return -(-k // 256) * 256


def _v3_cases(qtype: str, small: bool) -> list[CheckCase]:
    """v3 on repacked weights: what v2 is checked on; for the K-quants the same shapes, knobs,
    forms and seams with K (and a seam's N_a, GEMV B's K) in whole super-blocks."""
    from kernels import native

    fit = _k_shape if qtype in WHOLE_SUPERS else (lambda k: k)
    odd = [(n, k) for n in SMALL_N for k in (K_SMALL_K if qtype in WHOLE_SUPERS else SMALL_K)]
    cases = [_gemv_case("v3", qtype, 1 + c % 4, n, k)
             for c, (n, k) in enumerate(odd + ([] if small else [*REAL, *VOCAB]))]
    if not small:
        cases += [_gemv_case("v3", qtype, m, 4096, 4096) for m in (1, 2, 3)]
    for m in (1, 2, 3, 4):
        tail = small or m > 2
        cases.append(_fused_case("rmsnorm", qtype, m, *((33, fit(4128)) if tail else (4096, 4096)), version="v3"))
        cases.append(_fused_case("swiglu", qtype, m, *((33, fit(4128)) if tail else (4096, 14336)), version="v3"))
        cases.append(_fused_case("swiglu", qtype, m, *((33, fit(4128)) if tail else (4096, 14336)), residual=True,
                                 version="v3"))
        cases.append(_fused_case("plain", qtype, m, *((33, fit(4128)) if tail else (4096, 4096)), residual=True,
                                 version="v3"))
    for kind, m, n, k, residual, knobs in V3_KNOB_CASES[:2] if small else V3_KNOB_CASES:
        cases.append(_fused_case(kind, qtype, m, n, fit(k), residual, knobs, version="v3"))
    for m, f, k, norm, knobs in GATE_UP_SWIGLU_CASES[4:6] if small else GATE_UP_SWIGLU_CASES:
        cases.append(_gate_up_swiglu_case(qtype, m, f, fit(k), norm, knobs))
    for m in (5, 16) if small else (5, 16, 512):
        cases.append(_gemv_case("linear v3", qtype, m, *((33, fit(96)) if small else (4097, fit(4128)))))
    for m, n, k, residual, knobs in (QMM_CASES[:2] + QMM_CASES[11:12] + QMM_CASES[20:21] + QMM_CASES[32:33]
                                     + QMM_DEPTH_CASES[:1] if small else QMM_CASES + QMM_DEPTH_CASES):
        cases.append(_gemv_case("qmm", qtype, m, n, fit(k), residual, knobs))
    for kind, act, m, n, k, knobs in QMM_FUSED_CASES[:2] + QMM_FUSED_CASES[8:9] if small else QMM_FUSED_CASES:
        cases.append(_qmm_fused_case(kind, act, qtype, m, n, fit(k), knobs))
    for m, n, k, knobs in QMM_NORM_OUT_CASES[:2] if small else QMM_NORM_OUT_CASES:
        cases.append(_qmm_norm_out_case(qtype, m, n, fit(k), knobs))
    for kind, act, m, n, k, residual, knobs in QMM_LAST_CASES[:2] if small else QMM_LAST_CASES:
        cases.append(_qmm_last_case(kind, act, qtype, m, n, fit(k), residual, knobs))
    if qtype in ("q4_0", "q8_0") and native.available():  # the native GEMM (Hopper)
        for m, n, k, residual, knobs in QMM_MMA_CASES[:2] if small else QMM_MMA_CASES:
            cases.append(_gemv_case("qmm mma", qtype, m, n, k, residual, knobs))
        for m, n, k, knobs in QMM_MMA_GATED_CASES[:2] if small else QMM_MMA_GATED_CASES:
            cases.append(_qmm_fused_case("gated", "silu", qtype, m, n, k, knobs, mma=True))
        for m, n, k, residual, knobs in QMM_MMA_ROWS8_CASES[:1] if small else QMM_MMA_ROWS8_CASES:
            cases.append(_gemv_case("qmm mma rows8", qtype, m, n, k, residual, knobs))
        for m, n, k, knobs in [] if small else QMM_MMA_ROWS8_GATED_CASES:
            cases.append(_qmm_fused_case("gated", "silu", qtype, m, n, k, knobs, rows8=True, mma=True))
        for m, n, k, residual, knobs in QMM_MMA_SK_CASES[:1] if small else QMM_MMA_SK_CASES:
            cases.append(_gemv_case("qmm mma", qtype, m, n, k, residual, knobs))
        for m, n, k, knobs in [] if small else QMM_MMA_SK_GATED_CASES:
            cases.append(_qmm_fused_case("gated", "silu", qtype, m, n, k, knobs, mma=True))
        if not small:
            cases.append(_qmm_mma_sk_again_case(qtype))
    if qtype in ("q4_0", "q8_0"):
        for m, n, k, residual, knobs in QMM_ROWS8_CASES[:1] if small else QMM_ROWS8_CASES:
            cases.append(_gemv_case("qmm rows8", qtype, m, n, k, residual, knobs))
        for kind, act, m, n, k, knobs in [] if small else QMM_ROWS8_FUSED_CASES:
            cases.append(_qmm_fused_case(kind, act, qtype, m, n, k, knobs, rows8=True))
    for m in (3, 9, 16) if small else (3, 9, 16, 512):  # each path of linear(): GEMV, GEMVs + add, addmm
        cases.append(_gemv_case("linear v3", qtype, m, *((33, fit(96)) if small else (4097, fit(4128))),
                                residual=True))
    if not small:
        cases.append(_projection_case(qtype, (4096, 1024, 1024), 4096, 1, packed=True))
        cases.append(_projection_case(qtype, (14336, 14336), 4096, 2, packed=True))
    for swiglu, m, n_a, k_a, n_b, knobs in V3_SEAM_CASES[6:8] if small else V3_SEAM_CASES:
        cases.append(_seam_case(qtype, swiglu, m, fit(n_a), fit(k_a), n_b, knobs, packed=True))
    for m, n, k, knobs in HEAD_ARGMAX_CASES[2:4] + HEAD_ARGMAX_CASES[6:] if small else HEAD_ARGMAX_CASES:
        cases.append(_head_argmax_case(qtype, m, n, fit(k), knobs))
    return cases


def _vs_gguf(qtype: str) -> CheckCase:
    def run(rng: np.random.Generator) -> list[Comparison]:
        from gguf import GGMLQuantizationType as T
        from gguf import quants

        w = _weights(rng, 33, 4128)
        gtype = {"q4_0": T.Q4_0, "q8_0": T.Q8_0}[qtype]
        ours, theirs = quantize(w, qtype), quants.quantize(w, gtype).reshape(33, -1)
        return [exact("quantized bytes", ours, theirs),
                exact("dequantized", dequantize(ours, qtype, 4128),
                      quants.dequantize(theirs, gtype).reshape(w.shape))]

    return CheckCase("gemv", f"reference.quantize_{qtype}", "vs gguf.quants", dict(N=33, K=4128),
                     run, needs_gpu=False)


def reference_cases() -> list[CheckCase]:
    return [_vs_gguf(q) for q in QTYPES]


# ---- benchmarks ------------------------------------------------------------------------------------
BENCH_SHAPES = (*REAL, *VOCAB)
# MLX's own low-bit formats beside the K-quants: affine 4, 5 and 6 bits in groups of 64 (an fp16
# scale and bias a group: 4.5, 5.5 and 6.5 bits a weight against Q4_K's 4.5, Q5_K's 5.5, Q6_K's 6.5625)
K_MLX_PEERS = ("4bit-gs64", "5bit-gs64", "6bit-gs64")


def _device_blocks(qtype: str, n: int, k: int) -> mx.array:
    """Random blocks made on the device (GPU quantize of fp16 normals): cheap for any size."""
    from kernels.gemv import quantize as gpu_quantize

    w = (mx.random.normal((n, k), key=mx.random.key(n * 7 + k)) * 0.05).astype(mx.float16)
    q = gpu_quantize(w, qtype, check_finite=False)
    mx.eval(q)
    return q


def _device_legacy_blocks(qtype: str, n: int, k: int) -> mx.array:
    """Random Q4_1/Q5_0/Q5_1 blocks (_legacy_blocks', drawn on the host: no GPU quantizer)."""
    q = mx.array(_legacy_blocks(np.random.default_rng(n * 7 + k), qtype, n, k))
    mx.eval(q)
    return q


def _device_k_blocks(qtype: str, n: int, k: int) -> mx.array:
    """Random K-quant super-blocks made on the device (_k_blocks' kind: random bytes, drawn fp16
    scales)."""
    keys = mx.random.split(mx.random.key(n * 7 + k))
    supers, size = n * k // 256, formats.row_bytes(qtype.upper(), 256)
    body = mx.random.randint(0, 256, (supers, size), key=keys[0]).astype(mx.uint8)
    lo, hi = K_SCALES[qtype]
    pairs = 1 if qtype == "q6_k" else 2
    scales = mx.random.uniform(lo, hi, (supers, pairs), key=keys[1]).astype(mx.float16).view(mx.uint8)
    parts = [body[:, :208], scales] if qtype == "q6_k" else [scales, body[:, 4:]]
    q = mx.concatenate(parts, axis=1).reshape(n, -1)
    mx.eval(q)
    return q


def _weights_once(qtype: str, *shapes: tuple[int, int]):
    """A function that gives each rotated input set its own device copy of random blocks, one
    matrix per (N, K) shape; the blocks are made on the first call only."""
    made: list[mx.array] = []

    def fresh() -> list[mx.array]:
        if not made:
            make = (_device_k_blocks if qtype in K_QTYPES else _device_legacy_blocks
                    if qtype in LEGACY_QTYPES or qtype in IQ4_QTYPES else _device_blocks)
            made.extend(make(qtype, n, k) for n, k in shapes)
        return [b + mx.array(0, mx.uint8) for b in made]

    return fresh


def _io_bytes(qtype: str, n: int, k: int, m: int = 1, x_width: int | None = None) -> int:
    return storage_bytes(qtype, n, k) + 2 * m * (x_width or k) + 2 * m * n


def _packed_once(qtype: str, *shapes: tuple[int, int]):
    """_weights_once's sets, each repacked for the v3 GEMVs (kernels.gemv.repack)."""
    from kernels.gemv import repack

    fresh = _weights_once(qtype, *shapes)
    return lambda: [repack(w, qtype, n, k) for w, (n, k) in zip(fresh(), shapes)]


def _bench_ours(version: str, qtype: str, n: int, k: int) -> BenchCase:
    from kernels.gemv import gemv_v1, gemv_v2, gemv_v3

    fn = {"v1": gemv_v1, "v2": gemv_v2, "v3": gemv_v3}[version]
    weights = (_packed_once if version == "v3" else _weights_once)(qtype, (n, k))

    def make():
        return {"w": weights()[0], "x": mx.random.normal((1, k)).astype(mx.float16)}

    nbytes = _io_bytes(qtype, n, k)
    return BenchCase("gemv", "gemv-m1", f"gemv_{qtype}", version, dict(M=1, N=n, K=k), make,
                     lambda s: [fn(s["x"], s["w"], qtype, n, k)], nbytes, 2 * n * k, nbytes)


def _bench_mlx(kind: str, n: int, k: int) -> BenchCase:
    def make():
        w = (mx.random.normal((n, k)) * 0.05).astype(mx.float16)
        state = {"x": mx.random.normal((1, k)).astype(mx.float16)}
        if kind == "fp16":
            state["w"] = w
        else:
            state["wq"], state["scales"], state["biases"] = mx.quantize(w, group_size=int(kind.split("gs")[1]),
                                                                        bits=int(kind[0]))
        return state

    if kind == "fp16":
        kernel, nbytes = "mlx.matmul-fp16", 2 * n * k
        step = lambda s: [s["x"] @ s["w"].T]  # noqa: E731
    else:
        bits, group = int(kind[0]), int(kind.split("gs")[1])
        kernel, nbytes = "mlx.quantized_matmul", n * k * bits // 8 + n * (k // group) * 4
        step = lambda s: [mx.quantized_matmul(s["x"], s["wq"], s["scales"], s["biases"],  # noqa: E731
                                              transpose=True, group_size=group, bits=bits)]
    nbytes += 2 * k + 2 * n
    return BenchCase("gemv", "gemv-m1", kernel, kind, dict(M=1, N=n, K=k), make, step, nbytes,
                     2 * n * k, nbytes)


def _bench_fused(kind: str, path: str, qtype: str, n: int, k: int) -> BenchCase:
    """Fused RMSNorm+GEMV or SiLU+down (`path` 'fused', or 'fused-v3' on repacked weights) against
    the unfused sequence ('unfused': mx.fast.rms_norm or MLX's silu * up, then the v2 GEMV).
    Bytes: the fused kernel's."""
    from kernels.gemv import gemv_v2, rmsnorm_gemv, silu_down_gemv

    weights = (_packed_once if path == "fused-v3" else _weights_once)(qtype, (n, k))
    width = k if kind == "rmsnorm" else 2 * k

    def make():
        return {"w": weights()[0],
                "x": mx.random.normal((1, width)).astype(mx.float16),
                "gamma": (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)}

    if kind == "rmsnorm":
        name = f"rmsnorm_gemv_{qtype}"
        if path.startswith("fused"):
            step = lambda s: [rmsnorm_gemv(s["x"], s["gamma"], 1e-5, s["w"], qtype, n, k)]  # noqa: E731
        else:
            step = lambda s: [gemv_v2(mx.fast.rms_norm(s["x"], s["gamma"], 1e-5), s["w"], qtype, n, k)]  # noqa: E731
    else:
        name = f"silu_down_gemv_{qtype}"
        if path.startswith("fused"):
            step = lambda s: [silu_down_gemv(s["x"], s["w"], qtype, n, k)]  # noqa: E731
        else:
            def step(s):
                g, u = s["x"][:, :k], s["x"][:, k:]
                return [gemv_v2(g * mx.sigmoid(g) * u, s["w"], qtype, n, k)]
    nbytes = _io_bytes(qtype, n, k, x_width=width) + (2 * k if kind == "rmsnorm" else 0)
    return BenchCase("gemv", "gemv-fused", name, path, dict(M=1, N=n, K=k), make, step, nbytes,
                     2 * n * k, nbytes)


def _bench_projection(path: str, qtype: str, sizes: tuple[int, ...], k: int) -> BenchCase:
    """QKV or gate+up as one GEMV over the concatenated matrix ('fused'; 'fused-v3': repacked) or
    one v2 GEMV per part."""
    from kernels.gemv import concat_rows, gemv, repack, split

    weights = _weights_once(qtype, *((n, k) for n in sizes))

    def make():
        parts = weights()
        state = {"x": mx.random.normal((1, k)).astype(mx.float16)}
        if path.startswith("fused"):
            state["w"] = concat_rows(parts)
            if path == "fused-v3":
                state["w"] = repack(state["w"], qtype, sum(sizes), k)
        else:
            state.update({f"w{i}": p for i, p in enumerate(parts)})
        return state

    if path.startswith("fused"):
        step = lambda s: split(gemv(s["x"], s["w"], qtype, sum(sizes), k), sizes)  # noqa: E731
    else:
        step = lambda s: [gemv(s["x"], s[f"w{i}"], qtype, n, k) for i, n in enumerate(sizes)]  # noqa: E731
    name = ("qkv" if len(sizes) == 3 else "gate_up") + f"_{qtype}"
    nbytes = _io_bytes(qtype, sum(sizes), k)
    return BenchCase("gemv", "gemv-fused", name, path,
                     dict(M=1, N="+".join(map(str, sizes)), K=k), make, step, nbytes,
                     2 * sum(sizes) * k, nbytes)


def _bench_ffn(path: str, qtype: str, f: int, d: int) -> BenchCase:
    """The FFN's two launches on repacked weights, RMSNorm+gate+up then down + residual, with
    silu(gate) * up in gate+up's epilogue ('swiglu-at-gate_up': gemv.gate_up_swiglu, then a plain
    GEMV over [1, F]) or in down's staging ('swiglu-at-down': rmsnorm_gemv, then silu_down_gemv)."""
    from kernels.gemv import gate_up_swiglu, gemv, rmsnorm_gemv, silu_down_gemv

    weights = _packed_once(qtype, (2 * f, d), (d, f))

    def make():
        gate_up, down = weights()
        return {"gate_up": gate_up, "down": down, "x": mx.random.normal((1, d)).astype(mx.float16),
                "gamma": (1 + 0.1 * mx.random.normal((d,))).astype(mx.float16)}

    if path == "swiglu-at-gate_up":
        def step(s):
            a = gate_up_swiglu(s["x"], s["gate_up"], qtype, 2 * f, d, gamma=s["gamma"], eps=1e-5)
            return [gemv(a, s["down"], qtype, d, f, residual=s["x"])]
    else:
        def step(s):
            g = rmsnorm_gemv(s["x"], s["gamma"], 1e-5, s["gate_up"], qtype, 2 * f, d)
            return [silu_down_gemv(g, s["down"], qtype, d, f, residual=s["x"])]
    nbytes = storage_bytes(qtype, 2 * f, d) + storage_bytes(qtype, d, f) + 2 * (3 * d + d)
    return BenchCase("gemv", "gemv-fused", f"ffn_{qtype}", path, dict(M=1, N=f"{f}+{f}|{d}", K=f"{d}|{f}"),
                     make, step, nbytes, 2 * 3 * f * d, nbytes)


def _bench_batched(path: str, qtype: str, m: int, n: int, k: int) -> BenchCase:
    """M rows of X: the v2 GEMV in launches of up to 4 rows ('gemv'; 'gemv-v3': v3 on repacked
    weights), the quantized GEMM on repacked weights ('qmm', M <= 64), and dequantize + MLX matmul
    ('batched'), to find where one overtakes the other."""
    from kernels.gemv import MAX_M, dequantize, gemv, qmm, qmm_mma

    weights = (_packed_once if path in ("gemv-v3", "qmm", "qmm-mma") else _weights_once)(qtype, (n, k))

    def make():
        return {"w": weights()[0], "x": mx.random.normal((m, k)).astype(mx.float16)}

    if path == "qmm":
        step = lambda s: [qmm(s["x"], s["w"], qtype, n, k)]  # noqa: E731
    elif path == "qmm-mma":  # the native GEMM on the warp MMA (Hopper)
        step = lambda s: [qmm_mma(s["x"], s["w"], qtype, n, k)]  # noqa: E731
    elif path.startswith("gemv"):
        def step(s):
            return [gemv(s["x"][i:i + MAX_M], s["w"], qtype, n, k) for i in range(0, m, MAX_M)]
    else:
        step = lambda s: [s["x"] @ dequantize(s["w"], qtype, n, k).T]  # noqa: E731
    nbytes = _io_bytes(qtype, n, k, m)
    return BenchCase("gemv", "gemv-batched", f"linear_{qtype}", path, dict(M=m, N=n, K=k), make,
                     step, nbytes, 2 * m * n * k, nbytes)


def _bench_qmm_fused(path: str, qtype: str, m: int, n: int, k: int) -> BenchCase:
    """qmm fused as a short prompt's layer runs it (the plan's gemm phase) against the launches it
    replaces, M rows of X on repacked weights: 'residual' / 'qmm, add' (O and down), 'norm' /
    'rmsnorm, qmm' (QKV), 'norm+silu' / 'rmsnorm, qmm, swiglu' ([gate; up] of 2F = N rows, Y
    [M, F]). Read by gpu_us, each call alone (harness/timing.py)."""
    from kernels.gemv import qmm
    from kernels.loop import rmsnorm, swiglu

    weights = _packed_once(qtype, (n, k))
    gated = path in ("norm+silu", "rmsnorm, qmm, swiglu")
    n_out = n // 2 if gated else n

    def make():
        return {"w": weights()[0], "x": mx.random.normal((m, k)).astype(mx.float16),
                "r": mx.random.normal((m, n_out)).astype(mx.float16),
                "gamma": (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)}

    steps = {
        "residual": lambda s: [qmm(s["x"], s["w"], qtype, n, k, residual=s["r"])],
        "qmm, add": lambda s: [qmm(s["x"], s["w"], qtype, n, k) + s["r"]],
        "norm": lambda s: [qmm(s["x"], s["w"], qtype, n, k, gamma=s["gamma"], eps=1e-5)],
        "rmsnorm, qmm": lambda s: [qmm(rmsnorm(s["x"], s["gamma"], 1e-5), s["w"], qtype, n, k)],
        "norm+silu": lambda s: [qmm(s["x"], s["w"], qtype, n, k, gamma=s["gamma"], eps=1e-5, activation="silu")],
        "rmsnorm, qmm, swiglu": lambda s: [swiglu(qmm(rmsnorm(s["x"], s["gamma"], 1e-5), s["w"], qtype, n, k))],
    }
    nbytes = storage_bytes(qtype, n, k) + 2 * m * k + 2 * m * n_out * (2 if path in ("residual", "qmm, add") else 1)
    return BenchCase("gemv", "gemv-qmm-fused", f"qmm_{qtype}", path, dict(M=m, N=n, K=k), make, steps[path],
                     nbytes, 2 * m * n * k, nbytes)


# A short prompt's fused qmm launches on Llama-3-8B's shapes: O and down with the residual, QKV
# with the RMSNorm prologue, [gate; up] with the prologue and the SiLU epilogue
QMM_FUSED_BENCH = ((("residual", "qmm, add"), ((4096, 4096), (4096, 14336))),
                   (("norm", "rmsnorm, qmm"), ((6144, 4096),)),
                   (("norm+silu", "rmsnorm, qmm, swiglu"), ((28672, 4096),)))


def _bench_pair(path: str, qtype: str, qtype_b: str, n: int, n_b: int, k: int) -> BenchCase:
    """A fused projection whose parts differ in block type (Q4_K_M's QKV where attn_v is Q6_K):
    RMSNorm + both matrices in one launch ('pair', kernels.gemv's w_b) against what it replaced,
    an RMSNorm+GEMV a type joined by mx.concatenate ('two-gemvs-concat'). Repacked weights."""
    from kernels.gemv import rmsnorm_gemv

    first, second = _packed_once(qtype, (n, k)), _packed_once(qtype_b, (n_b, k))

    def make():
        return {"w": first()[0], "w_b": second()[0], "x": mx.random.normal((1, k)).astype(mx.float16),
                "gamma": (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16)}

    if path == "pair":
        step = lambda s: [rmsnorm_gemv(s["x"], s["gamma"], 1e-5, s["w"], qtype, n, k, w_b=s["w_b"])]  # noqa: E731
    else:
        def step(s):
            parts = [rmsnorm_gemv(s["x"], s["gamma"], 1e-5, w, t, rows, k)
                     for w, t, rows in ((s["w"], qtype, n), (s["w_b"], qtype_b, n_b))]
            return [mx.concatenate(parts, axis=-1)]
    nbytes = storage_bytes(qtype, n, k) + storage_bytes(qtype_b, n_b, k) + 2 * k + 2 * k + 2 * (n + n_b)
    return BenchCase("gemv", "gemv-fused", f"qkv_pair_{qtype}_{qtype_b}", path, dict(M=1, N=f"{n}|{n_b}", K=k),
                     make, step, nbytes, 2 * (n + n_b) * k, nbytes)


def _bench_head_argmax(path: str, qtype: str, n: int, k: int) -> BenchCase:
    """A greedy decode token's output head: RMSNorm + GEMV with the argmax in its launch ('fused',
    rmsnorm_gemv_argmax) against the head, then kernels.loop.argmax ('head-then-argmax'), on
    repacked weights. Launches on one argmax scratch must not overlap: each set has its own, and
    each call on a set waits for the token of the last (mx.depends), on both paths alike. verify:
    0 where both paths give the same token on one set, else inf."""
    from kernels.gemv import head_argmax_scratch, rmsnorm_gemv, rmsnorm_gemv_argmax
    from kernels.loop import argmax
    from kernels.runtime import depends

    weights = _packed_once(qtype, (n, k))

    def make():
        return {"w": weights()[0], "x": mx.random.normal((1, k)).astype(mx.float16),
                "gamma": (1 + 0.1 * mx.random.normal((k,))).astype(mx.float16),
                "scratch": head_argmax_scratch(qtype, n, k), "token": mx.zeros((1,), mx.int32)}

    def fused(s):
        _, s["token"] = rmsnorm_gemv_argmax(depends(s["x"], [s["token"]]), s["gamma"], 1e-5, s["w"], qtype, n, k,
                                            s["scratch"])
        return [s["token"]]

    def apart(s):
        s["token"] = argmax(rmsnorm_gemv(depends(s["x"], [s["token"]]), s["gamma"], 1e-5, s["w"], qtype, n, k))
        return [s["token"]]

    def verify() -> float:
        st = make()
        a = np.array(fused(dict(st))[0])
        return 0.0 if np.array_equal(a, np.array(apart(dict(st))[0])) else float("inf")

    nbytes = storage_bytes(qtype, n, k) + 2 * k + 2 * k + 2 * n + 4
    return BenchCase("gemv", "head-argmax", f"head_argmax_{qtype}", path, dict(M=1, N=n, K=k), make,
                     fused if path == "fused" else apart, nbytes, 2 * n * k, nbytes, verify)


# The heads of Qwen3-0.6B (Q8_0) and Llama-3-8B (Q4_0, and llama-quantize's Q6_K of its Q4_K_M)
HEAD_BENCH_SHAPES = (("q8_0", 151936, 1024), ("q4_0", 128256, 4096), ("q6_k", 128256, 4096))


# Pairs as the K mixes' fused QKV has them: Llama-3-8B Q4_K_M ([q; k] Q4_K, v Q6_K), Qwen3-0.6B's.
PAIR_BENCH_SHAPES = (("q4_k", "q6_k", 5120, 1024, 4096), ("q4_k", "q6_k", 3072, 1024, 1024))
# Llama-3-8B's projections (QKV, O, gate+up, down) for qmm against dequantize + MLX's matmul
QMM_BENCH_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def bench_cases(quick: bool = False) -> list[BenchCase]:
    from kernels import native

    cases = []
    shapes = BENCH_SHAPES[:2] if quick else BENCH_SHAPES
    for n, k in shapes:
        for qtype in QTYPES:
            cases += [_bench_ours(v, qtype, n, k) for v in ("v1", "v2", "v3")]
        cases += [_bench_mlx(kind, n, k) for kind in ("fp16", "4bit-gs32", "8bit-gs32")]
        cases += [_bench_ours("v3", qtype, n, k) for qtype in (*K_QTYPES, *LEGACY_QTYPES, *IQ4_QTYPES)]
        cases += [_bench_mlx(kind, n, k) for kind in K_MLX_PEERS]
    fused = ("fused", "fused-v3", "unfused")
    for qtype in QTYPES:
        for n, k in ((4096, 4096), (14336, 4096)) if not quick else ((4096, 4096),):
            cases += [_bench_fused("rmsnorm", p, qtype, n, k) for p in fused]
        for n, k in ((4096, 14336),) if not quick else ():
            cases += [_bench_fused("swiglu", p, qtype, n, k) for p in fused]
        if not quick:
            for sizes in ((4096, 1024, 1024), (14336, 14336)):
                cases += [_bench_projection(p, qtype, sizes, 4096) for p in fused]
            cases += [_bench_ffn(p, qtype, f, d) for f, d in ((14336, 4096), (3072, 1024))
                      for p in ("swiglu-at-gate_up", "swiglu-at-down")]
    for m in (1, 2, 4, 8, 16, 32, 64, 512) if not quick else (4, 16):
        cases += [_bench_batched(p, "q4_0", m, 4096, 4096) for p in ("gemv", "gemv-v3", "batched")]
        cases += [_bench_batched("qmm", "q4_0", m, 4096, 4096)] if 4 < m <= 64 else []
    for qtype in ("q4_0", "q8_0", "q4_k", "q6_k") if not quick else ("q4_0",):  # a short prompt's projections
        mma = ("qmm-mma",) if qtype in ("q4_0", "q8_0") and native.available() else ()
        for m in (16, 64) if not quick else (16,):
            cases += [_bench_batched(p, qtype, m, n, k) for n, k in QMM_BENCH_SHAPES
                      for p in ("qmm", *mma, "batched")]
    for qtype in ("q4_0", "q8_0") if not quick else ("q4_0",):  # qmm fused, against what it replaces
        for m in (16, 64) if not quick else (16,):
            cases += [_bench_qmm_fused(p, qtype, m, n, k) for paths, shapes in QMM_FUSED_BENCH
                      for n, k in shapes for p in paths]
    for m in (1, 2, 3, 4) if not quick else ():  # M = 2..4 against M = 1, large shapes
        cases += [_bench_batched("gemv-v3", qtype, m, n, k) for qtype in (*QTYPES, *K_QTYPES)
                  for n, k in ((14336, 4096), (4096, 14336), (128256, 4096))]
    for qtype in K_QTYPES if not quick else ():  # the K-quants' fused forms, as the loop runs them
        cases += [_bench_fused("rmsnorm", "fused-v3", qtype, n, 4096) for n in (4096, 14336)]
        cases.append(_bench_fused("swiglu", "fused-v3", qtype, 4096, 14336))
        cases += [_bench_ffn("swiglu-at-gate_up", qtype, f, d) for f, d in ((14336, 4096), (3072, 1024))]
    for shape in PAIR_BENCH_SHAPES if not quick else ():
        cases += [_bench_pair(path, *shape) for path in ("pair", "two-gemvs-concat")]
    for shape in HEAD_BENCH_SHAPES[:1] if quick else HEAD_BENCH_SHAPES:
        cases += [_bench_head_argmax(path, *shape) for path in ("fused", "head-then-argmax")]
    return cases


SWEEP_ROWS = (1, 2, 4)
SWEEP_SIMDS = (2, 4, 8)
# The decode loop's fused projections, each in the format its ANCHORS model uses: Llama-3-8B's
# QKV, O, gate+up, down and head in Q4_0, Qwen3-0.6B's QKV, O, gate+up and down in Q8_0.
SWEEP_SHAPES = (("q4_0", 6144, 4096), ("q4_0", 4096, 4096), ("q4_0", 28672, 4096),
                ("q4_0", 4096, 14336), ("q4_0", 128256, 4096), ("q8_0", 4096, 1024),
                ("q8_0", 1024, 2048), ("q8_0", 6144, 1024), ("q8_0", 1024, 3072))


# The K-quants' v3 (their targets' shapes, 14336 x 4096 and 4096 x 14336, and the 8B's gate+up).
K_SWEEP_SHAPES = tuple((q, n, k) for q in K_QTYPES for n, k in ((14336, 4096), (4096, 14336), (28672, 4096)))


def _sweep(fn, weights_once, settings, shapes=SWEEP_SHAPES, rows=(1,)) -> list[BenchCase]:
    """Sweep one kernel's launch knobs over shapes, at each of `rows` rows of X: `settings(qtype,
    m, n, k)` is (variant label, knobs) pairs; each row's rel_err is against the default launch's
    output on the same inputs. Knob sk (qmm_mma's stream-K) takes counters made with the inputs, so
    that its rows time the kernel alone."""
    cases = []
    for qtype, n, k in shapes:
        weights = weights_once(qtype, (n, k))
        for m in rows:
            def make(m=m, n=n, k=k, weights=weights):
                return {"w": weights()[0], "x": mx.random.normal((m, k)).astype(mx.float16),
                        "counters": mx.zeros((n // 16 + 1,), mx.uint32)}

            for label, knobs in settings(qtype, m, n, k):
                def step(st, qtype=qtype, n=n, k=k, knobs=knobs):
                    extra = {"counters": st["counters"]} if knobs.get("sk") else {}
                    return [fn(st["x"], st["w"], qtype, n, k, **knobs, **extra)]

                def verify(make=make, step=step, qtype=qtype, n=n, k=k):
                    st = make()
                    return rel_err(np.array(step(st)[0]), np.array(fn(st["x"], st["w"], qtype, n, k)))

                nbytes = _io_bytes(qtype, n, k, m)
                cases.append(BenchCase("gemv", "gemv-sweep", f"gemv_{qtype}", label, dict(M=m, N=n, K=k), make,
                                       step, nbytes, 2 * m * n * k, nbytes, verify))
    return cases


# v3's knobs: R rows a SIMD group, NSIMD, P 16-byte loads in flight a lane and row, and the grid
# cap G (0: none; 528 = 132 SMs x 4).
V3_SWEEP = [dict(rows=r, simds=s, depth=p, max_groups=0) for r in (1, 2, 4) for s in (4, 8) for p in (2, 4, 8)] + \
    [dict(rows=2, simds=4, depth=4, max_groups=g) for g in (264, 528, 1056)]


# qmm's knobs: NB blocks of 8 rows a SIMD group (NB 16-byte loads of W in flight a lane), WN SIMD
# groups across rows (a threadgroup's 8 * NB * WN rows share its loads of X in L1), WK along K in a
# threadgroup, KS threadgroups along K a row block (split K, a second launch adding the parts:
# so that few row blocks still fill the GPU, while each threadgroup reads X only for its part),
# and PF (1: the next super-chunk's weights loaded before this one's products; a397c5c's SU 2,
# two super-chunks a pass, won once in ten: its second super-chunk loaded after the first's
# products, PTX showed). NB 8 (each load of X shared by 64 rows of W, twice NB 4's) was never
# swept before: NVRTC gives it 132-136 registers at 16 rows (Q4_0; 7 threadgroups of 2 SIMD
# groups an SM, 14 warps, against NB 4's 5 of 4, 20 warps), and decoding a row block just before
# its products, not every block first, saves none (132 against 136: ptxas interleaves them).
# X is read by each lane straight from memory (no staging): X's traffic from L2 is (threadgroups
# of rows) x M x K x 2 bytes, the weights' N x K x 0.5625 (Q4_0), so at 16 rows a threadgroup of
# 32 rows reads more X than W. XS (2 or 3 buffers) stages X for the threadgroup instead: with 8
# SIMD groups across N, X comes from L2 once for 128-256 rows of W and no SIMD group reads it from
# L1, where its loads were most of the sectors (e04a574's profile). WST 1 loads W evict-first, so
# that W, read once, does not push X's lines out of L1 (X's hits were 74% at 16 rows). At a short
# prompt's and a batch's row counts on the 8B's O, gate+up and down shapes and Qwen3-0.6B's
# four; M = 16 first (the GEMM's 16-row target). a5c36c6's sweep made XS 2 the rule on the 8B's
# gate+up and down past 32 rows, and its profile found the warps waiting on W's loads: PF 1 and
# NB 8 over staged X ask whether more of W in flight a warp pays (NVRTC, Q4_0: NB 8 XS 2 146-153
# registers at 16 rows, 255 with spills at 64), and 32 rows place the staged rule's start. Timed by gpu_us, each call alone
# (harness/timing.py: the rounds' side-by-side calls had hidden what threadgroups a launch leaves
# idle, a12307b)
# W's ring on its own schedule (wr 1..4 without staged X): 2 to 4 super-chunks in flight a lane,
# where w_order_probe's loads alone went from 61% of the copy peak to 84-89% (3bd2061)
QMM_DEPTH_SWEEP = [dict(nb=nb, wn=wn, wk=wk, ks=ks, pf=0, wr=wr) for ks in (1, 4)
                   for nb, wn, wk, wrs in ((4, 2, 2, (1, 2, 3)), (4, 4, 1, (2,)), (2, 2, 2, (2, 4))) for wr in wrs]
QMM_SWEEP = [dict(nb=nb, wn=wn, wk=wk, ks=ks, pf=0) for ks in (1, 2, 4, 8)
             for nb, wn, wk in ((1, 4, 2), (1, 8, 1), (2, 2, 2), (2, 2, 4), (2, 4, 1), (2, 4, 2), (2, 8, 1),
                                (4, 2, 1), (4, 2, 2), (4, 4, 1))] + \
    [dict(nb=nb, wn=wn, wk=wk, ks=ks, pf=1) for ks in (1, 2, 4) for nb, wn, wk in ((2, 4, 1), (2, 4, 2), (2, 8, 1),
                                                                                  (4, 2, 1))] + \
    [dict(nb=8, wn=wn, wk=wk, ks=ks, pf=0) for ks in (1, 2, 4, 8) for wn, wk in ((1, 2), (1, 4), (2, 1), (2, 2))] + \
    [dict(nb=nb, wn=wn, wk=wk, ks=ks, pf=0, xs=xs) for xs in (2, 3) for ks in (1, 2, 4)
     for nb, wn, wk in ((2, 8, 1), (4, 8, 1), (4, 4, 1), (2, 4, 2), (4, 4, 2))] + \
    [dict(nb=4, wn=2, wk=2, ks=ks, pf=0, wst=1) for ks in (1, 2, 4, 8)] + \
    [dict(nb=nb, wn=8, wk=1, ks=ks, pf=0, xs=2, wst=1) for ks in (1, 2) for nb in (2, 4)] + \
    [dict(nb=nb, wn=wn, wk=1, ks=ks, pf=1, xs=2) for ks in (1, 2, 4) for nb, wn in ((4, 4), (2, 8))] + \
    [dict(nb=8, wn=wn, wk=1, ks=ks, pf=0, xs=2) for ks in (1, 2, 4) for wn in (2, 4)] + \
    [dict(nb=nb, wn=wn, wk=wk, ks=ks, pf=0, xs=xs, wr=1) for xs in (2, 3) for ks in (1, 2, 4)
     for nb, wn, wk in ((4, 4, 1), (2, 8, 1), (2, 4, 2), (4, 4, 2))] + QMM_DEPTH_SWEEP
QMM_SWEEP_SHAPES = (("q4_0", 4096, 4096), ("q4_0", 28672, 4096), ("q4_0", 4096, 14336),
                    # the 8B's QKV and head: the head past 32 rows is staged by the rule, unswept
                    ("q4_0", 6144, 4096), ("q4_0", 128256, 4096),
                    # Qwen3-0.6B's QKV, O, gate+up and down (Q8_0), whose rule is 10cb374's knobs
                    # unsplit on end-to-end rows that the a397c5c sweep (QKV and down only, without
                    # NB2-WN2-WK4) could not rank
                    ("q8_0", 4096, 1024), ("q8_0", 1024, 2048), ("q8_0", 6144, 1024), ("q8_0", 1024, 3072))
QMM_SWEEP_ROWS = (16, 32, 64)


def qmm_sweep_label(knobs: dict) -> str:
    """A qmm sweep row's variant: its knobs, KS only where K is split."""
    return "qmm NB{nb}-WN{wn}-WK{wk}".format(**knobs) + (f"-KS{knobs['ks']}" if knobs["ks"] > 1 else "") + \
        ("-PF1" if knobs.get("pf") else "") + (f"-XS{knobs['xs']}" if knobs.get("xs") else "") + \
        ("-WST1" if knobs.get("wst") else "") + (f"-WR{knobs['wr']}" if knobs.get("wr") else "")


# stream-K over one and two CTAs an SM of the H200's 132 (sk), on the rule's 16-row tiles and ST2-SG4
QMM_MMA_SK_SWEEP = [dict(tm=tm, nw=nw, ks=1, stages=st, sg=sg, pf=0, sk=sk)
                    for tm, nw, st, sg in ((2, 4, 3, 2), (2, 4, 2, 4), (1, 4, 3, 2), (2, 8, 2, 2)) for sk in (132, 264)]
# the 8B's four matrices in Q4_0 and Qwen3-0.6B's four in Q8_0 (the models of the serve targets); 2 slots of
# 4 groups since 3443a9d, where they led the 16-row gate+up (kernels/gemv/NOTES.md)
QMM_MMA_SWEEP_SHAPES = QMM_SWEEP_SHAPES[:4] + QMM_SWEEP_SHAPES[5:]
QMM_MMA_SWEEP = [dict(tm=tm, nw=nw, ks=ks, stages=st, sg=sg, pf=pf) for tm in (1, 2) for nw in (4, 8, 16)
                 for ks in (1, 2, 4, 8) for st, sg in ((3, 1), (4, 1), (2, 2), (3, 2), (4, 2), (2, 4), (3, 4))
                 for pf in (0, 4)] + \
    [dict(tm=tm, nw=nw, kw=kw, ks=ks, stages=st, sg=sg, pf=0) for tm in (1, 2)
     for nw, kw in ((4, 2), (8, 2), (8, 4), (16, 2)) for ks in (1, 2, 4)
     for st, sg in ((2, 1), (3, 1), (4, 1), (2, 2), (3, 2))] + QMM_MMA_SK_SWEEP


# qmm_mma on RowBlocks (variant '...-R8'): the rule and the settings near the top of cb7ec50's sweep on
# the 8B's matrices (Q4_0) and Qwen3-0.6B's (Q8_0), at 16 and 64 rows, each also on Packed weights
# (QMM_MMA_SWEEP's rows of the same label, `qmm_mma_rows8_match`). SG 1 and 4: on RowBlocks a stage's
# pieces of a row block are one run of 512 SG bytes (Q4_0), where on Packed a row's are 64 SG
QMM_MMA_ROWS8_ROWS = (16, 64)
QMM_MMA_ROWS8_SWEEP = [{}] + [dict(tm=tm, nw=nw, kw=kw, ks=ks, stages=st, sg=sg, pf=0) for tm, nw, kw, ks, st, sg in (
    (2, 4, 1, 1, 3, 2), (2, 4, 1, 1, 2, 2), (2, 4, 1, 1, 3, 1), (2, 4, 1, 1, 4, 1), (2, 4, 1, 1, 2, 4),
    (2, 8, 1, 1, 2, 2), (1, 4, 1, 1, 3, 2), (1, 8, 1, 1, 3, 2), (2, 8, 2, 1, 2, 2), (1, 8, 4, 1, 3, 2),
    (1, 4, 4, 1, 3, 2), (2, 4, 1, 2, 3, 2), (2, 4, 1, 4, 3, 2), (1, 4, 1, 4, 3, 2), (2, 4, 1, 8, 2, 2),
    (2, 4, 1, 8, 3, 2))]


def qmm_mma_sweep_label(knobs: dict) -> str:
    """A qmm_mma sweep row's variant: its knobs, KW only past one K warp, PF only where W's rows are
    asked of the L2; 'mma rule' for none."""
    if not knobs:
        return "mma rule"
    return "mma TM{tm}-NW{nw}".format(**knobs) + (f"-KW{knobs['kw']}" if knobs.get("kw", 1) > 1 else "") + \
        "-KS{ks}-ST{stages}-SG{sg}".format(**knobs) + (f"-PF{knobs['pf']}" if knobs.get("pf") else "") + \
        (f"-SK{knobs['sk']}" if knobs.get("sk") else "")


def qmm_mma_rows8_match() -> str:
    """`lathe bench gemv --sweep -k` for QMM_MMA_ROWS8_SWEEP: its RowBlocks rows and the Packed rows
    of the same knobs (those in QMM_MMA_SWEEP)."""
    labels = [qmm_mma_sweep_label(knobs) for knobs in QMM_MMA_ROWS8_SWEEP]
    return "|".join(f"[{label}{r8}]" for label in labels for r8 in ("", "-R8"))


def _qmm_mma_sweep() -> list[BenchCase]:
    """qmm_mma's knobs (QMM_MMA_SWEEP, variant 'mma TM.-NW.[-KW.]-KS.-ST.-SG.[-PF.]') where the ring fits the
    shared memory and each part of K has a stage, on QMM_MMA_SWEEP_SHAPES at QMM_SWEEP_ROWS rows; then
    on RowBlocks (QMM_MMA_ROWS8_SWEEP, '-R8'); none where native kernels do not run."""
    from kernels import native
    from kernels.gemv import QMM_MMA_SMEM, interleave_rows, qmm_mma, qmm_mma_smem

    if not native.available():
        return []

    def fits(qtype, m, n, k, tm, nw, ks, stages, sg, kw=1, sk=0, **_):
        tiles, stages_k = -(-n // (16 * tm * nw // kw)), -(-k // (128 * sg * kw))
        return qmm_mma_smem(m, qtype, tm, nw, stages, sg, kw) <= QMM_MMA_SMEM and ks <= stages_k \
            and 66 <= tiles * ks <= 1056 and sk <= tiles * stages_k  # a half to 8 waves; a unit a CTA

    def settings(qtype, m, n, k):
        return [(qmm_mma_sweep_label(knobs), knobs) for knobs in QMM_MMA_SWEEP if fits(qtype, m, n, k, **knobs)]

    def rows8_settings(qtype, m, n, k):
        return [(qmm_mma_sweep_label(knobs) + "-R8", knobs) for knobs in QMM_MMA_ROWS8_SWEEP
                if not knobs or fits(qtype, m, n, k, **knobs)]

    def rows8_once(qtype, *shapes):
        packed = _packed_once(qtype, *shapes)
        return lambda: [interleave_rows(w) for w in packed()]

    # Packed beside the RowBlocks rows where QMM_MMA_SWEEP has no row of the label (the rule, and a few)
    swept = {qmm_mma_sweep_label(knobs) for knobs in QMM_MMA_SWEEP}
    unswept = [knobs for knobs in QMM_MMA_ROWS8_SWEEP if qmm_mma_sweep_label(knobs) not in swept]

    def packed_settings(qtype, m, n, k):
        return [(qmm_mma_sweep_label(knobs), knobs) for knobs in unswept if not knobs or fits(qtype, m, n, k, **knobs)]

    return [case for m in QMM_SWEEP_ROWS for case in _sweep(qmm_mma, _packed_once, settings, QMM_MMA_SWEEP_SHAPES,
                                                             rows=(m,))] + \
        [case for m in QMM_MMA_ROWS8_ROWS
         for case in _sweep(qmm_mma, _packed_once, packed_settings, QMM_MMA_SWEEP_SHAPES, rows=(m,))] + \
        [case for m in QMM_MMA_ROWS8_ROWS
         for case in _sweep(qmm_mma, rows8_once, rows8_settings, QMM_MMA_SWEEP_SHAPES, rows=(m,))]


def _qmm_sweep() -> list[BenchCase]:
    """qmm's knobs (QMM_SWEEP, variant 'qmm NB.-WN.-WK.[-KS.][-PF1][-XS.][-WST1][-WR.]') where they fit the threadgroup
    memory, at QMM_SWEEP_ROWS rows."""
    from kernels.gemv import block_format, qmm, qmm_geometry, qmm_ring_words

    def fits(qtype, m, n, k, knobs) -> bool:
        try:
            qmm_geometry(m, n, k, knobs["nb"], knobs["wn"], knobs["wk"], xs=knobs.get("xs", 0),
                         w_ring=qmm_ring_words(block_format(qtype)[0], knobs.get("wr", 0)), wr=knobs.get("wr", 0))
            return True
        except ValueError:
            return False

    def given(knobs):
        # pf, xs and wr 0 where not swept: the rule (option qmm_x_staged, auto) stages X, and fetches
        # W ahead, on the 8B's shapes
        return dict(knobs, pf=knobs.get("pf", 0), xs=knobs.get("xs", 0), wr=knobs.get("wr", 0))

    def settings(qtype, m, n, k):
        # staged X only from K = 4096 (a5c36c6: 3-60% slower on every Qwen3 shape)
        return [(qmm_sweep_label(knobs), given(knobs)) for knobs in QMM_SWEEP
                if fits(qtype, m, n, k, knobs) and (k >= 4096 or not knobs.get("xs"))]

    def rows8_settings(qtype, m, n, k):
        return [(qmm_sweep_label(knobs) + "-R8", given(knobs)) for knobs in QMM_ROWS8_SWEEP
                if fits(qtype, m, n, k, knobs)]

    def rows8_once(qtype, *shapes):
        from kernels.gemv import interleave_rows

        packed = _packed_once(qtype, *shapes)
        return lambda: [interleave_rows(w) for w in packed()]

    # a row count at a time, over every shape: a sweep cut short by its time limit has the first
    return [case for m in QMM_SWEEP_ROWS for case in _sweep(qmm, _packed_once, settings, QMM_SWEEP_SHAPES, rows=(m,))] + \
        [case for m in QMM_SWEEP_ROWS for case in _sweep(qmm, rows8_once, rows8_settings, QMM_ROWS8_SHAPES, rows=(m,))]


# W as RowBlocks (variant '...-R8'): the 8B's four matrices at the rule's settings and d1c7394's
# fastest, each also in QMM_SWEEP on Packed weights (`qmm_rows8_match`: both, for `-k`)
QMM_ROWS8_SHAPES = (("q4_0", 4096, 4096), ("q4_0", 28672, 4096), ("q4_0", 4096, 14336), ("q4_0", 6144, 4096))
QMM_ROWS8_SWEEP = [dict(nb=4, wn=2, wk=2, ks=ks, pf=0) for ks in (1, 2, 4, 8)] + \
    [dict(nb=nb, wn=wn, wk=1, ks=ks, pf=0, xs=2, wr=1) for ks in (1, 4) for nb, wn in ((4, 4), (2, 8))] + \
    [dict(nb=nb, wn=wn, wk=1, ks=ks, pf=1, xs=2) for ks in (1, 4) for nb, wn in ((4, 4), (2, 8))] + QMM_DEPTH_SWEEP


def qmm_rows8_match(sweep: list[dict] | None = None) -> str:
    """`lathe bench gemv --sweep -k` over QMM_ROWS8_SWEEP (or a part of it, `sweep`): its RowBlocks
    rows and the same settings on Packed weights (whole variant labels, so that no other setting
    matches)."""
    labels = [qmm_sweep_label(knobs) for knobs in (QMM_ROWS8_SWEEP if sweep is None else sweep)]
    return "|".join(f"[{label}{r8}]" for label in labels for r8 in ("", "-R8"))


# w_order_probe's settings on the 8B's gate+up quants (28672 x 4096 Q4_0: 58.7 MB, past L2): each
# order at qmm's NB 4 with 1, 2 and 4 super-chunks in flight a lane, in the grid of one block group
# a SIMD group (G0) and capped at 264 and 528 threadgroups of 4 SIMD groups (2 and 4 an SM on 132
# SMs: qmm's 16-row grid holds about 3.4 warps a scheduler, 13 an SM)
W_PROBE_SHAPE = (28672, 4096 // 32)
W_PROBE_SWEEP = [dict(order=o, nb=4, depth=d, groups=g) for o in ("qmm", "rows", "interleaved")
                 for d in (1, 2, 4) for g in (0, 264, 528)]


def _w_order_probe_cases() -> list[BenchCase]:
    """w_order_probe (benchmark gemv-probe, variant '<order> NB.-D.-G.'): the bytes of W over GPU
    time, as a share of the copy peak, for each load order; its check is the XOR of the words."""
    from kernels.gemv import w_order_probe

    n, chunks_k = W_PROBE_SHAPE
    words = n * chunks_k * 4

    def make():  # 32 random bits a word, from two 16-bit draws (randint's own are coarser past 2**24)
        halves = [mx.random.randint(0, 1 << 16, (words,), dtype=mx.uint32) for _ in range(2)]
        return {"w": (halves[0] << 16) | halves[1]}

    cases = []
    for knobs in W_PROBE_SWEEP:
        def step(st, knobs=knobs):
            return [w_order_probe(st["w"], n, chunks_k, **knobs)]

        def verify(step=step):
            st = make()
            got = np.bitwise_xor.reduce(np.array(step(st)[0]))
            return 0.0 if got == np.bitwise_xor.reduce(np.array(st["w"])) else 1.0

        label = "{order} NB{nb}-D{depth}-G{groups}".format(**knobs)
        # M 0: the probe reads W alone, no rows of X (results.csv's gemv rows need M)
        cases.append(BenchCase("gemv", "gemv-probe", "w_order_probe", label, dict(M=0, N=n, K=chunks_k * 32), make,
                               step, words * 4, 0, words * 4, verify))
    return cases


def sweep_cases() -> list[BenchCase]:
    """v2's launch knobs (R rows per SIMD group, NSIMD SIMD groups per threadgroup) where they
    fit in threadgroup memory, then v3's (V3_SWEEP, variant 'v3 R.-NSIMD.-P.-G.'), then qmm's
    (QMM_SWEEP, at 16, 32 and 64 rows), then w_order_probe's (W_PROBE_SWEEP)."""
    from kernels.gemv import SMEM_BUDGET, gemv_v2, gemv_v3, v2_smem_bytes

    def v2_settings(qtype, m, n, k):
        return [(f"R{r}-NSIMD{s}", dict(rows=r, simds=s)) for r in SWEEP_ROWS for s in SWEEP_SIMDS
                if v2_smem_bytes(qtype, 1, r, s, 2048) <= SMEM_BUDGET]

    def v3_settings(qtype, m, n, k):
        return [("v3 R{rows}-NSIMD{simds}-P{depth}-G{max_groups}".format(**knobs), knobs) for knobs in V3_SWEEP]

    return (_sweep(gemv_v2, _weights_once, v2_settings) + _sweep(gemv_v3, _packed_once, v3_settings)
            + _sweep(gemv_v3, _packed_once, v3_settings, K_SWEEP_SHAPES) + _qmm_mma_sweep() + _qmm_sweep()
            + _w_order_probe_cases())


def plots(df: pd.DataFrame, out_dir: Path, peak_gbs: float) -> list[Path]:
    from harness.plots import bandwidth_plot, fused_unfused_plot

    paths = []
    m1 = df[df.benchmark == "gemv-m1"]
    if not m1.empty:
        paths.append(bandwidth_plot(m1, "bytes", out_dir / "gemv-m1.png",
                                    "GEMV M=1: GB/s against bytes moved", peak_gbs=peak_gbs,
                                    x_label="bytes moved per call (weights + x + y)", gpu_time=True))
    fused = df[df.benchmark == "gemv-fused"].copy()
    if not fused.empty:
        fused["op"] = fused.kernel + "\n" + fused.N.astype(str) + "x" + fused.K.astype(str)
        paths.append(fused_unfused_plot(fused, "op", out_dir / "gemv-fused.png",
                                        "Fused against unfused, M=1: us per call (ratio: unfused / this; "
                                        "the FFN pairs: SiLU at down / this; the QKV pairs: two GEMVs + concat / this)",
                                        baseline_variant=("unfused", "swiglu-at-down", "two-gemvs-concat")))
    batched = df[(df.benchmark == "gemv-batched") & (df.kernel == "linear_q4_0")
                 & (df.N.astype(str) == "4096") & (df.K.astype(str) == "4096")]
    if not batched.empty:
        paths.append(bandwidth_plot(batched, "M", out_dir / "gemv-batched.png",
                                    "Q4_0 4096x4096, M rows: GEMV launches vs dequantize + matmul",
                                    peak_gbs=peak_gbs))
    return paths
