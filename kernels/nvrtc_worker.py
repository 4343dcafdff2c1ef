"""A worker process of `kernels.jit_cache.prepare` (MLX's modules) and `kernels.native.prepare`
(native cubins): NVRTC compiles of a share of them.

It imports no MLX: MLX's CUDA backend takes device memory when it is imported, and a pytest shard
starts a worker a core (12 shards x 16 workers ran the H100 out of memory at a12307b:
`cudaMallocManaged ... out of memory` at import, 88 tests failed). NVRTC needs no GPU.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

from kernels.ptx import CompileError, load_nvrtc, run_nvrtc


def write_module(path: Path, kernel: str, symbol: str, cubin: bytes) -> None:
    """The module MLX looks for (path: <dir>/<module>.ptx) and its symbol table, each written
    whole (a rename), the table first: MLX looks for the .ptx and then reads the .txt."""
    for suffix, data in ((".txt", f"{kernel}\t{symbol}\n".encode()), (".ptx", cubin)):
        # a short name: the module's own can be 230 characters, and with these suffixes its
        # 257 passed the file system's 255 (a token_block's, seen on the H100: the cache went off)
        write_whole(path.with_suffix(suffix), data, f".{os.getpid()}.{threading.get_ident()}{suffix}.part")


def write_whole(path: Path, data: bytes, part_name: str | None = None) -> None:
    """`data` at `path` by a rename, so that another process never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(part_name or f".{os.getpid()}.{threading.get_ident()}.{path.name}.part")
    part.write_bytes(data)
    os.replace(part, path)


def run_workers(payloads: list[dict]) -> list:
    """One worker process a payload, all at once; each one's result, or None where it died (or
    could not read its payload): the caller compiles that share some other way."""
    procs = [subprocess.Popen([sys.executable, "-m", "kernels.nvrtc_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) for _ in payloads]
    for proc, payload in zip(procs, payloads):  # each reads its whole input before it works
        try:
            proc.stdin.write(pickle.dumps(payload))
            proc.stdin.close()
        except OSError:  # it died before reading (a broken pipe)
            pass
    results = []
    for proc in procs:
        out = proc.stdout.read()
        results.append(pickle.loads(out) if proc.wait() == 0 and out else None)
    return results


def compile_share(payload: dict) -> list[str | None]:
    """A worker's share: compile and write each (source, kernel, path); NVRTC's log for each
    that does not compile."""
    lib = load_nvrtc(payload["nvrtc"])
    logs = []
    for source, kernel, path in payload["jobs"]:
        try:
            cubin, symbol = run_nvrtc(lib, source, f"{Path(path).stem}.cu", payload["options"],
                                      payload["headers"], kernel, cubin=True)
            write_module(Path(path), kernel, symbol, cubin)
            logs.append(None)
        except CompileError as exc:
            logs.append(str(exc))
    return logs


def compile_native(payload: dict) -> list[str | None]:
    """A share of kernels.native.prepare's: compile each (source, file name, options, path) to a
    cubin written whole at path; NVRTC's log for each that does not compile."""
    lib = load_nvrtc(payload["nvrtc"])
    logs = []
    for source, file_name, opts, path in payload["native"]:
        try:
            cubin, _ = run_nvrtc(lib, source, file_name, opts, cubin=True)
            write_whole(Path(path), cubin)
            logs.append(None)
        except CompileError as exc:
            logs.append(str(exc))
    return logs


if __name__ == "__main__":  # a pickled share on stdin, the logs on stdout
    share = pickle.load(sys.stdin.buffer)
    sys.stdout.buffer.write(pickle.dumps(compile_native(share) if "native" in share else compile_share(share)))
