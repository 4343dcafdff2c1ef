"""The RoPE family's benchmarks: decode latency and prefill bandwidth, fused against unfused and
against the MLX built-in path, on Llama-3-8B, Qwen3-0.6B and Qwen2.5-7B head shapes.

Bytes are the operation's minimum (each input read once, each output written once): Q, K, V read;
rotated Q, K rows and V rows written. Every path of one shape is charged the same bytes, so GB/s
compares paths directly; flops count 6 per rotated pair plus 4 per normed element.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pandas as pd

from harness.bench import BenchCase

DECODE_MAX_SEQ = 4096
DECODE_POS = 4000
PREFILL_SEQS = (512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Model:
    name: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    neox: bool
    theta: float
    head_norm: bool


LLAMA3_8B = Model("llama3-8b", 32, 8, 128, neox=False, theta=500000.0, head_norm=False)
QWEN3_06B = Model("qwen3-0.6b", 16, 8, 128, neox=True, theta=1000000.0, head_norm=True)
# NeoX pairs without head norms (Qwen2.5), so the plain NeoX kernels meet their own unfused path.
QWEN25_7B = Model("qwen2.5-7b", 28, 4, 128, neox=True, theta=1000000.0, head_norm=False)
MODELS = (LLAMA3_8B, QWEN3_06B, QWEN25_7B)


def roofline(m: Model, seq: int, q_only: bool = False) -> tuple[int, int]:
    """(bytes, flops) of RoPE (+ norms) + KV write for seq tokens; q_only: RoPE of Q alone."""
    heads = m.n_heads if q_only else m.n_heads + 2 * m.n_kv_heads
    nbytes = 2 * seq * heads * m.head_dim * 2
    rotated = seq * (m.n_heads if q_only else m.n_heads + m.n_kv_heads) * m.head_dim
    flops = 3 * rotated
    if m.head_norm and not q_only:
        nbytes += 2 * m.head_dim * 4
        flops += 4 * rotated
    return nbytes, flops


def _rand(*shape: int) -> mx.array:
    return mx.random.normal(shape).astype(mx.float16)


def _state(m: Model, seq: int, max_seq: int) -> dict:
    d = m.head_dim
    state = dict(q=_rand(seq, m.n_heads * d), k=_rand(seq, m.n_kv_heads * d),
                 v=_rand(seq, m.n_kv_heads * d), k_cache=_rand(m.n_kv_heads, max_seq, d),
                 v_cache=_rand(m.n_kv_heads, max_seq, d))
    if seq == 1:
        state["qkv"] = mx.concatenate([state["q"], state["k"], state["v"]], axis=1).reshape(-1)
    if m.head_norm:
        state["q_norm"] = 1 + 0.1 * mx.random.normal((d,))
        state["k_norm"] = 1 + 0.1 * mx.random.normal((d,))
    return state


def _path(m: Model, kernel: str, form: str, pos: int):
    """A step function: one call of `kernel` on a state, storing the updated caches back."""
    import kernels.rope as kr
    from kernels.rope.paths import mlx_kv_write, unfused_kv_write

    rope_kw = dict(theta=m.theta)
    norms = lambda s: dict(q_norm=s["q_norm"], k_norm=s["k_norm"]) if m.head_norm else {}

    def call(s):
        caches = (s["k_cache"], s["v_cache"])
        if kernel in ("rope_qkv_write", "rope_neox_qkv_write"):
            return kr.rope_qkv_write(s["qkv"], *caches, pos, n_heads=m.n_heads, neox=m.neox,
                                     form=form, **rope_kw)
        if kernel in ("rope_batch_kv_write", "rope_neox_batch_kv_write"):
            return kr.rope_batch_kv_write(s["q"], s["k"], s["v"], *caches, pos, neox=m.neox,
                                          form=form, **rope_kw)
        if kernel == "head_norm_rope_neox_kv_write":
            return kr.head_norm_rope_neox_kv_write(s["q"], s["k"], s["v"], s["q_norm"], s["k_norm"],
                                                   *caches, pos, form=form, **rope_kw)
        if kernel == "unfused":
            return unfused_kv_write(s["q"], s["k"], s["v"], *caches, pos, neox=m.neox, form=form,
                                    **norms(s), **rope_kw)
        if kernel == "mlx.fast.rope":
            return mlx_kv_write(s["q"], s["k"], s["v"], *caches, pos, neox=m.neox, **norms(s),
                                **rope_kw)
        raise ValueError(kernel)

    def step(s):
        res = call(s)
        s["k_cache"], s["v_cache"] = res.k_cache, res.v_cache
        return [res.q]

    return step


def _q_only(m: Model, peer: bool):
    """RoPE of Q alone: our rope / rope_neox, or mx.fast.rope on the heads-first layout."""
    from kernels.rope import rope, rope_neox

    def step(s):
        q = s["q"].reshape(s["q"].shape[0], m.n_heads, m.head_dim)
        if peer:
            x = q.transpose(1, 0, 2)[None]
            return [mx.fast.rope(x, m.head_dim, traditional=not m.neox, base=m.theta, scale=1.0,
                                 offset=0)]
        return [(rope_neox if m.neox else rope)(q, 0, theta=m.theta)]

    return step


def _fused_kernels(m: Model, seq: int) -> list[str]:
    if seq == 1:
        names = ["rope_neox_qkv_write" if m.neox else "rope_qkv_write"]
    else:
        names = ["rope_neox_batch_kv_write" if m.neox else "rope_batch_kv_write"]
    if m.head_norm:
        names.insert(0, "head_norm_rope_neox_kv_write")
    return names


def bench_cases(quick: bool = False) -> list[BenchCase]:
    cases = []
    seqs = PREFILL_SEQS[::2] if quick else PREFILL_SEQS
    for m in MODELS:
        for seq in (1, *seqs):
            decode = seq == 1
            max_seq, pos = (DECODE_MAX_SEQ, DECODE_POS) if decode else (seq, 0)
            phase = "decode" if decode else "prefill"
            shape = dict(seq=seq, head_dim=m.head_dim, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads)
            nbytes, flops = roofline(m, seq)
            make = lambda m=m, seq=seq, max_seq=max_seq: _state(m, seq, max_seq)
            set_bytes = nbytes // 2 + 4 * m.n_kv_heads * max_seq * m.head_dim
            paths = [(k, f) for k in _fused_kernels(m, seq) for f in ("in_place", "functional")]
            paths += [("unfused", "in_place"), ("unfused", "functional"), ("mlx.fast.rope", "peer")]
            if m.head_norm:  # without its norms, the plain NeoX kernel does less work: not comparable
                paths = [(k, f) for k, f in paths if "neox_qkv" not in k and "neox_batch" not in k]
            for kernel, form in paths:
                cases.append(BenchCase("rope", f"rope-{phase}-{m.name}", kernel, form, shape, make,
                                       _path(m, kernel, form, pos), nbytes, flops, set_bytes))
            if not decode:
                qb, qf = roofline(m, seq, q_only=True)
                for kernel, peer in (("rope_neox" if m.neox else "rope", False), ("mlx.fast.rope", True)):
                    cases.append(BenchCase("rope", f"rope-q-only-{m.name}", kernel, "q-only",
                                           shape, make, _q_only(m, peer), qb, qf, set_bytes))
    return cases


SWEEP_HPT = (2, 4, 8, 16)
SWEEP_THREADS = (128, 256, 512)


def _tuned(step, **knobs):
    """`step` with kernels.rope.TUNING overridden while it builds its graph."""
    import kernels.rope as kr

    def tuned_step(s):
        saved = dict(kr.TUNING)
        kr.TUNING.update(knobs)
        try:
            return step(s)
        finally:
            kr.TUNING.clear()
            kr.TUNING.update(saved)

    return tuned_step


def _same_as_default(make, step, tuned_step):
    """rel_err of a tuned launch against the default one on the same inputs: the knobs change
    which thread computes an element, never how, so anything but 0 is a bug."""
    import numpy as np

    from reference import rel_err

    def verify() -> float:
        s = make()
        mx.eval(list(s.values()))
        want = [np.array(a) for a in step(dict(s))]
        got = [np.array(a) for a in tuned_step(dict(s))]
        return max(0.0 if np.array_equal(g, w) else rel_err(g, w) for g, w in zip(got, want))

    return verify


def sweep_cases() -> list[BenchCase]:
    """The launch knobs (heads per thread, threads per threadgroup) of the prefill kernels; each
    row's rel_err compares its output with the default launch's (0: bit-identical)."""
    cases = []
    for m, seq in ((LLAMA3_8B, 8192), (LLAMA3_8B, 2048), (QWEN3_06B, 8192)):
        shape = dict(seq=seq, head_dim=m.head_dim, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads)
        make = lambda m=m, seq=seq: _state(m, seq, seq)
        nbytes, flops = roofline(m, seq)
        qb, qf = roofline(m, seq, q_only=True)
        set_bytes = nbytes // 2 + 4 * m.n_kv_heads * seq * m.head_dim
        batch = "rope_neox_batch_kv_write" if m.neox else "rope_batch_kv_write"
        for hpt in SWEEP_HPT:
            for threads in SWEEP_THREADS:
                knobs = dict(hpt_short=hpt, hpt_long=hpt, threads=threads)
                variant = f"hpt{hpt}-tg{threads}"
                fused = _path(m, batch, "in_place", 0)
                tuned = _tuned(fused, **knobs)
                cases.append(BenchCase("rope", f"rope-sweep-{m.name}", batch, variant, shape, make,
                                       tuned, nbytes, flops, set_bytes,
                                       _same_as_default(make, fused, tuned)))
                rope_name = "rope_neox" if m.neox else "rope"
                plain = _q_only(m, False)
                tuned = _tuned(plain, **knobs)
                cases.append(BenchCase("rope", f"rope-sweep-{m.name}", rope_name, variant, shape,
                                       make, tuned, qb, qf, set_bytes,
                                       _same_as_default(make, plain, tuned)))
    return cases


def plots(df: pd.DataFrame, out_dir: Path, peak_gbs: float) -> list[Path]:
    """Bandwidth against seq per model (prefill and Q-only), and fused/unfused bars at decode."""
    from harness.plots import bandwidth_plot, fused_unfused_plot

    paths = []
    for bench in sorted(b for b in df.benchmark.unique() if "decode" not in b and "sweep" not in b):
        sub = df[df.benchmark == bench]
        paths.append(bandwidth_plot(sub, "seq", out_dir / f"{bench}.png",
                                    f"{bench}: GB/s against tokens", peak_gbs=peak_gbs))
    decode = df[df.benchmark.str.contains("decode")].copy()
    if not decode.empty:
        # Bars by path (fused / unfused / MLX, and form), groups by model and its fused kernel,
        # so that every group has the same bars in the same places.
        peers = decode.kernel.isin(["unfused", "mlx.fast.rope"])
        decode["variant"] = decode.kernel.where(peers, "fused") + " [" + decode.variant + "]"
        fused = decode[~peers].groupby("benchmark").kernel.first()
        decode["model"] = (decode.benchmark.str.removeprefix("rope-decode-") + "\n"
                           + decode.benchmark.map(fused))
        paths.append(fused_unfused_plot(decode, "model", out_dir / "rope-decode.png",
                                        "RoPE + KV write at decode: us per call (ratio: unfused in place / this)",
                                        baseline_variant="unfused [in_place]"))
    return paths
