"""The decode loop's projections alone, one after another as in the loop, timed on the GPU.

    python -m harness.tools.gemv_chain llama3-8b --qtype q4_0 [--layers 32] [--settings "SLOTS=0;SLOTS=2,MAX_GROUPS=396"]
        (the K-quants, q4_k, q5_k, q6_k: --layout packed only)
        [--layout gguf,packed] [--down swiglu,epilogue,plain]

A token of the fused variant, without attention: per layer RMSNorm+QKV, O (+ residual),
RMSNorm+gate+up and SiLU+down (+ residual), each taking the one before's output, and the output
head; weights of a preset's shapes, random, in `--sets` copies cycled through the layers so that
they stream from memory as a model's do. Each kernel waits for the one before, as in the loop,
which a benchmark round of independent calls does not show (kernels/gemv/NOTES.md). The GPU's
time per projection comes from its kernel trace (harness.tools.gpu_trace), for each GEMV setting given
(`--settings`: values of kernels.gemv.TUNING's keys, the formats' R, NSIMD, SLOTS, V3_R, V3_NSIMD,
V3_P and the shared ones; settings apart by ';'), on the GGUF blocks (v2) or repacked ones (v3),
or both (`--layout`). Where SiLU runs (`--down`): `swiglu` computes silu(gate) * up while down
stages X' (the loop with swiglu_at=down); `epilogue` in gate+up's epilogue (gemv.gate_up_swiglu,
repacked weights only; down is then plain, the loop's default); `plain` nowhere (down reads
gate+up's first F values as they are: the same weights, no SiLU, what either form costs).
Needs the CUDA backend and PyTorch.
"""

from __future__ import annotations

import argparse
import copy
from collections import defaultdict

import numpy as np

from harness.tools import gpu_trace
from reference import formats


def _weights(qtype: str, n: int, k: int):
    import mlx.core as mx

    from kernels.gemv import K_QTYPES, quantize

    if qtype in K_QTYPES:  # random super-blocks (the gemv checks' kind), repacked by the caller
        from harness.suites.gemv import _device_k_blocks

        return _device_k_blocks(qtype, n, k)

    w = (mx.random.normal((n, k)) * 0.02).astype(mx.float16)
    q = quantize(w, qtype, check_finite=False)
    mx.eval(q)
    return q


def parse_settings(text: str) -> list[str]:
    """'SLOTS=0;SLOTS=2,MAX_GROUPS=396' -> the settings, each checked (kernels.gemv.parse_tuning)."""
    from kernels import gemv

    settings = text.split(";")
    try:
        for setting in settings:
            gemv.parse_tuning(setting)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return settings


def run(preset: str, qtype: str, layers: int, sets: int, tokens: int, settings: list[str],
        layouts: tuple[str, ...] = ("gguf",), down: str = "swiglu") -> None:
    import mlx.core as mx

    import kernels.gemv as gemv
    from harness.program.models import PRESETS

    c = PRESETS[preset]
    d, ff = c.d_model, c.ff
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    shapes = {"qkv": (qkv, d), "o": (d, c.n_heads * c.head_dim), "gate_up": (2 * ff, d),
              "down": (d, ff)}
    raw = [{name: _weights(qtype, n, k) for name, (n, k) in shapes.items()} for _ in range(sets)]
    raw_head = _weights(qtype, c.vocab, d)
    packed = [{name: gemv.repack(w, qtype, *shapes[name]) for name, w in ws.items()} for ws in raw] \
        if "packed" in layouts else []
    packed_head = gemv.repack(raw_head, qtype, c.vocab, d) if "packed" in layouts else None
    gamma = mx.ones((d,), mx.float16)
    weights, head = raw, raw_head

    def token(x):
        for i in range(layers):
            w = weights[i % sets]
            h = gemv.rmsnorm_gemv(x, gamma, 1e-5, w["qkv"], qtype, *shapes["qkv"])
            o = gemv.gemv(h[:, : shapes["o"][1]], w["o"], qtype, *shapes["o"], residual=x)
            if down == "epilogue":
                a = gemv.gate_up_swiglu(o, w["gate_up"], qtype, *shapes["gate_up"], gamma=gamma, eps=1e-5)
                x = gemv.gemv(a, w["down"], qtype, *shapes["down"], residual=o)
                continue
            g = gemv.rmsnorm_gemv(o, gamma, 1e-5, w["gate_up"], qtype, *shapes["gate_up"])
            if down == "swiglu":
                x = gemv.silu_down_gemv(g, w["down"], qtype, *shapes["down"], residual=o)
            else:  # the same bytes of weights, X' read as it is: what the SiLU prologue costs
                x = gemv.gemv(g[:, : shapes["down"][1]], w["down"], qtype, *shapes["down"], residual=o)
        return x, gemv.rmsnorm_gemv(x, gamma, 1e-5, head, qtype, c.vocab, d)

    names = ["qkv", "o", "gate_up", "down"]
    print(f"{preset} {qtype}: {layers} layers of QKV {shapes['qkv']}, O {shapes['o']}, gate+up "
          f"{shapes['gate_up']}, down {shapes['down']}, head ({c.vocab}, {d}); {sets} weight sets")
    tuned = copy.deepcopy(gemv.TUNING)
    for layout, setting in [(lay, st) for lay in layouts for st in settings]:
        gemv.TUNING.update(copy.deepcopy(tuned))  # each from the tuned table, not the one before
        gemv.set_tuning(setting)
        weights, head = (packed, packed_head) if layout == "packed" else (raw, raw_head)
        label = f"{layout} {setting or 'tuned'}" + ("" if down == "swiglu" else f" down={down}")
        x = (mx.random.normal((1, d)) * 0.1).astype(mx.float16)
        for _ in range(2):  # compile, warm up
            x, logits = token(x)
            mx.eval(x, logits)
        with gpu_trace.kernel_trace() as kernels:
            for _ in range(tokens):
                x, logits = token(x)
                mx.eval(x, logits)
        gemvs = [k for k in kernels if "gemv" in k[2]]
        per = 4 * layers + 1
        if len(gemvs) != per * tokens:
            print(f"{label}: {len(gemvs)} GEMV kernels traced, expected {per * tokens}")
            continue
        by = defaultdict(list)
        for t in range(tokens):
            run_ = gemvs[t * per:(t + 1) * per]
            for j, (_, dur, _) in enumerate(run_[:-1]):
                by[names[j % 4]].append(dur)
            by["head"].append(run_[-1][1])
            by["token"].append(run_[-1][0] + run_[-1][1] - run_[0][0])
        out = ", ".join(f"{n} {np.median(by[n]):.1f}" for n in [*names, "head"])
        mbytes = {n: formats.row_bytes(qtype.upper(), shapes[n][1]) * shapes[n][0] / 1e6 for n in names}
        tbs = ", ".join(f"{n} {mbytes[n] / np.median(by[n]):.2f}" for n in names)
        print(f"{label}: us a call: {out}; token span {np.median(by['token']) / 1e3:.3f} ms; "
              f"TB/s: {tbs}")
    # The tuned table back for whoever runs next (a second --down took the last setting as its
    # "tuned" one: logs/gemv-chain-down-f1fd8dc.log, its second and third blocks).
    gemv.TUNING.update(copy.deepcopy(tuned))
    gemv.set_tuning("")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.tools.gemv_chain")
    parser.add_argument("model", nargs="?", default="llama3-8b")
    parser.add_argument("--qtype", default="q4_0")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--sets", type=int, default=4, help="distinct weight sets, cycled")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--settings", default="SLOTS=0;SLOTS=2",
                        help="GEMV TUNING settings to compare, apart by ';'")
    parser.add_argument("--layout", default="gguf",
                        help="weights: gguf (the v2 GEMVs), packed (repacked: v3), or both: gguf,packed")
    parser.add_argument("--down", default="swiglu",
                        help="where SiLU runs, one or more of: swiglu (down's staging), epilogue (gate+up's; "
                             "packed only), plain (nowhere)")
    args = parser.parse_args(argv)
    layouts = tuple(args.layout.split(","))
    downs = tuple(args.down.split(","))
    if not set(downs) <= {"swiglu", "epilogue", "plain"}:
        raise SystemExit(f"--down: swiglu, epilogue, plain (apart by ','), got {args.down!r}")
    if not set(layouts) <= {"gguf", "packed"}:
        raise SystemExit(f"--layout: gguf, packed or both, got {args.layout!r}")
    if "epilogue" in downs and "gguf" in layouts:
        raise SystemExit("--down epilogue runs on repacked weights: --layout packed")
    if not gpu_trace.available():
        raise SystemExit("gemv_chain needs the CUDA backend and PyTorch (the GPU's kernel trace)")
    for down in downs:
        run(args.model, args.qtype, args.layers, args.sets, args.tokens, parse_settings(args.settings), layouts,
            down)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
