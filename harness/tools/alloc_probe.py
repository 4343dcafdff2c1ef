"""Does a kernel's output that MLX places in a buffer the host last touched cost the kernel a
page migration? MLX's CUDA allocator keeps freed buffers in one cache for every kind of memory: an
array made from host data (mx.array(numpy)) or read by the host (np.array, .item(), which move a
device buffer to managed memory) goes back into it as managed memory, and a later kernel output
of the same size class may reuse it, its pages still on the host.

    python -m harness.tools.alloc_probe [--calls 40] [--rounds 2]

Times lathe's argmax over fp16 logits [8, 151936] (serve's step of 8 Qwen3-0.6B sequences) on the
GPU's clock (CUPTI, harness.tools.gpu_trace), in four cases a round: nothing read by the host;
the host reading each call's tokens; the same with every token array kept alive; a host-made
array of the tokens' size (32 bytes at 8 rows) freed before each call (serve's positions,
lengths and slots of 8 sequences are such arrays). Without a CUDA backend and PyTorch's profiler
there is nothing to time.
"""

from __future__ import annotations

import argparse

import numpy as np


def probe(calls: int = 40, rows: int = 8, vocab: int = 151936) -> list[tuple[str, float, float, float]]:
    """One round of the four cases: (case, median, min, max us of argmax's GPU time)."""
    import mlx.core as mx

    from harness.tools import gpu_trace
    from kernels import loop

    logits = mx.random.normal((rows, vocab)).astype(mx.float16)
    mx.eval(logits)
    for _ in range(5):
        mx.eval(loop.argmax(logits))
    out = []
    for name, read, keep, host_made in (("no host read", False, False, False),
                                        ("host reads each token array", True, False, False),
                                        ("host reads, arrays kept", True, True, False),
                                        ("host-made 32-byte array freed", False, False, True)):
        kept = []
        with gpu_trace.kernel_trace(None) as kernels:
            for _ in range(calls):
                if host_made:
                    made = mx.array(np.arange(rows, dtype=np.int32))  # the tokens' size class
                    del made
                token = loop.argmax(logits)
                mx.eval(token)
                if read:
                    np.array(token).tolist()
                if keep:
                    kept.append(token)
            mx.synchronize()
        us = [duration for _, duration, kernel in kernels if "argmax" in kernel]
        out.append((name, float(np.median(us)), min(us), max(us)))
    return out


def main(argv: list[str] | None = None) -> int:
    from harness.results import backend_line
    from harness.tools import gpu_trace

    p = argparse.ArgumentParser(prog="python -m harness.tools.alloc_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    print(backend_line())
    if not gpu_trace.available():
        print("no GPU trace here (it needs a CUDA backend and PyTorch's profiler): nothing to time")
        return 0
    for r in range(1, a.rounds + 1):
        for name, median, low, high in probe(a.calls):
            print(f"round {r}  {name:30s} argmax us: median {median:7.1f}  min {low:7.1f}  max {high:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
