"""Where a cold `lathe decode` spends its time before the first timed token: imports, loading the
GGUF file, building the decoder (weights to the device, fused matrices), and the first tokens of
step and compiled-pipelined mode (where kernels compile: NVRTC on CUDA, unless MLX finds them in
its PTX cache, $MLX_PTX_CACHE_DIR, by default under the system's temp directory).

    python -m harness.tools.startup llama3-8b:q4_0 tiny-llama:q8_0 [--variant fused] [--profile N]

Each model is timed in this one process, in order, so the first pays the process's one-time
costs; run it twice to see what a warm on-disk cache leaves.
"""

from __future__ import annotations

import argparse
import time

_began = time.perf_counter()
import mlx.core as mx  # noqa: E402

_imported = time.perf_counter() - _began


def time_start(name: str, qtype: str, variant: str = "fused", max_seq: int = 256) -> dict:
    """Seconds for each stage of a cold start of one model (see the module doc)."""
    import numpy as np

    from harness.program.decode import generate, make_decoder, model_file
    from harness.program.models import load_gguf

    stages = {}
    t = time.perf_counter()
    path = model_file(name, qtype)
    stages["file_s"] = time.perf_counter() - t  # written once into $LATHE_CACHE, then found
    t = time.perf_counter()
    model = load_gguf(path)
    stages["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    decoder = make_decoder(model, max_seq, variant)
    mx.eval(mx.zeros(1))
    stages["build_s"] = time.perf_counter() - t
    prompt = np.arange(4) % model.config.vocab
    for mode in ("step", "compiled-pipelined"):
        decoder.reset()
        t = time.perf_counter()
        generate(decoder, prompt, 2, mode)
        stages[f"first_{mode}_s"] = time.perf_counter() - t
    return dict(model=f"{name}:{qtype}", variant=variant, **{k: round(v, 2) for k, v in stages.items()})


def main(argv: list[str] | None = None) -> int:
    import cProfile
    import pstats

    import pandas as pd

    parser = argparse.ArgumentParser(prog="python -m harness.tools.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="PRESET:QTYPE or FILE.gguf:QTYPE")
    parser.add_argument("--variant", default="fused")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions (cProfile)")
    args = parser.parse_args(argv)
    print(f"imports (mlx): {_imported:.2f} s")
    rows = []
    for spec in args.models:
        name, _, qtype = spec.rpartition(":")
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        rows.append(time_start(name, qtype, args.variant))
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
