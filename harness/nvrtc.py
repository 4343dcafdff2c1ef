"""Every kernel instantiation compiled ahead: `lathe compile [family]`.

The family's check cases (all of them on CUDA, the small ones otherwise) run with their launches
recorded rather than executed
(kernels.runtime.recording: outputs are zeros, comparisons fail and are ignored), which collects
each distinct instantiation: its body and header as MLX gets them, its input and output dtypes
and its template constants (kernels.jit_cache.Instance).

- The whole check's cases (on CUDA, and for --record) are recorded in worker processes, each a
  share of them (record_in_parallel): the recording computes every case's inputs and float64
  reference on the host, 1471 s for 1685 cases in one process on a 2-core machine.
- On a CUDA machine they are compiled in parallel into the on-disk kernel cache
  (kernels.jit_cache), so that no later process waits for NVRTC: what to run once after
  installing, or after changing a body.
- Without a GPU they are compiled with NVRTC for sm_90 to PTX, so that a body which does not
  compile fails here rather than on the device. That needs NVRTC (libnvrtc.so, e.g. from the
  nvidia-cuda-nvrtc wheel; LATHE_NVRTC names it) and the CUDA headers (cuda_fp16.h and CCCL's
  cuda/std; LATHE_CUDA_INCLUDE, default /usr/local/cuda/include); MLX's device header, which a
  CPU build of MLX lacks, is replaced by a stub holding what the generated code uses
  (kernels.ptx). This checks compilation only; the device run checks results.
"""

from __future__ import annotations

import dataclasses
import gzip
import pickle
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels import ptx
from kernels.jit_cache import Instance, dtype_name
from kernels.runtime import include_line


def record_launches(cases, target: str | None = None) -> list:
    """The launches of the cases (kernels.runtime.Launch), recorded instead of executed, made for
    `target` (kernels.runtime.recording; default CUDA's on a machine without a GPU)."""
    jobs: list = []
    _record(cases, target, jobs.extend)
    return jobs


def record_instantiations(cases) -> list[Instance]:
    """The distinct CUDA modules the cases' launches need, in first-launch order."""
    return list(dict.fromkeys(inst for found in _instances_by_case(cases) for inst in found))


def _instances_by_case(cases) -> list[list[Instance]]:
    """Each case's distinct CUDA modules, in launch order. Each case's launches are let go once
    their modules are known: the whole check's cases hold gigabytes of inputs (recording gemv's
    kept 12 GB and growing)."""
    import kernels.runtime as rt

    found: list[list[Instance]] = []
    _record(cases, None, lambda jobs: found.append(list(dict.fromkeys(rt.instance(job, cuda=True) for job in jobs))))
    return found


def _record(cases, target: str | None, take) -> None:
    """Record each case's launches, handing them to `take` case by case."""
    import kernels.runtime as rt
    from kernels.runtime import LaunchLimitError

    with rt.recording(target, keep_prepared=True) as rec:
        for case in cases:
            try:
                case.run(np.random.default_rng(0))
            except LaunchLimitError:
                raise  # a launch the target refuses is a failure of the sweep, not a skipped case
            except Exception:  # noqa: BLE001 - comparisons on zeros fail; only launches matter
                pass
            take(rec.jobs + rec.prepared)
            rec.jobs.clear()
            rec.prepared.clear()


def compile_cases(families: list[str], small: bool, match: str | None = None) -> list:
    """What `lathe compile` records: the core calls, then each family's check cases (the small
    ones, or all) whose label `match` picks. The same list in every process (workers take shares
    of it by position)."""
    from harness.check import matches
    from harness.suites import select

    cases = list(core_calls())
    for fam in select(None):
        if fam.name in families:
            cases += [c for c in fam.check_cases(small=small) if match is None or matches(c.id, match)]
    return cases


def _record_share(families: list[str], small: bool, match: str | None, share: int, shares: int) -> list:
    """A worker's part of record_in_parallel: every shares-th case from the share-th, as (the
    case's position, its instances made picklable)."""
    cases = compile_cases(families, small, match)
    mine = range(share, len(cases), shares)
    return [(i, _picklable(found)) for i, found in zip(mine, _instances_by_case([cases[i] for i in mine]))]


def record_in_parallel(families: list[str], small: bool, match: str | None = None,
                       workers: int = 1) -> list[Instance]:
    """record_instantiations over compile_cases in `workers` spawned processes, each a share of
    the cases (the recording runs each case's inputs and float64 reference on the host: 1685
    cases took 1471 s in one process on a 2-core machine). The distinct instances in first-launch
    order, as one process records them."""
    if workers <= 1:
        return record_instantiations(compile_cases(families, small, match))
    import concurrent.futures
    import multiprocessing

    from harness.main_job import host_cores_shared

    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    with host_cores_shared(workers):
        futures = [pool.submit(_record_share, families, small, match, i, workers) for i in range(workers)]
    try:
        by_case = sorted(pair for f in futures for pair in f.result())
    finally:
        pool.shutdown(cancel_futures=True)
    return list(dict.fromkeys(inst for _, plain in by_case for inst in _unpicklable(plain)))


def core_calls() -> list:
    """Launches that belong to no family, and a kernel that no small check case launches: the
    compat probes, the peak's copy kernel, the unfused path's cache_read and the GEMM's load-order
    probe (gemv.w_order_probe, one call an order), as cases with a
    run(rng) method like a family's check cases."""
    import mlx.core as mx

    from kernels import compat, gemv, rope
    from kernels.bandwidth import copy16

    class Call:
        def __init__(self, fn):
            self.run = lambda rng: fn()

    h = lambda n: mx.zeros((n,), mx.float16)  # noqa: E731
    return [
        Call(lambda: compat.thread_ids((8, 4, 2), (4, 2, 2))),
        Call(lambda: compat.simd(mx.zeros((64,)), 32, 5)),
        Call(lambda: compat.memory(h(64), mx.zeros((64,), mx.uint32), h(64), 32)),
        Call(lambda: compat.simdgroup_matrix(mx.zeros((16, 16), mx.float16), mx.zeros((8, 8)), 3, 5)),
        Call(lambda: copy16(mx.zeros((64,), mx.uint32))),
        Call(lambda: rope.cache_read(mx.zeros((2, 8, 64), mx.float16), 1, 3, mx.zeros((1,), mx.uint32))),
        *(Call(lambda order=order, nb=nb, depth=depth: gemv.w_order_probe(
            mx.zeros((64 * 32 * 4,), mx.uint32), 64, 32, order=order, nb=nb, depth=depth, groups=1))
          for order, nb, depth in (("qmm", 4, 2), ("rows", 2, 1), ("interleaved", 2, 4))),
    ]


def compile_all(instances: list[Instance], arch: str = "compute_90") -> list[tuple[str, str]]:
    """NVRTC-compile each instance to PTX without a GPU; returns (kernel name, log) of every
    failure."""
    ptx.nvrtc(), ptx.include_dirs()  # FileNotFoundError here, before any compilation
    failures = []
    for inst in instances:
        try:
            ptx.compile_ptx(inst.mlx_source(), inst.kernel_name, arch)
        except ptx.CompileError as exc:
            failures.append((inst.kernel_name, str(exc)))
    return failures


# An SM of compute capability 9.0 (H100, H200), as the CUDA occupancy calculator takes it
SM90 = dict(registers=65536, register_unit=256, max_registers=255, warps=64, threadgroups=32,
            smem=233472, smem_reserved=1024)


def threadgroups_per_sm(registers: int, threads: int, smem: int, sm: dict = SM90) -> tuple[int, str]:
    """Resident threadgroups of `threads` threads an SM holds, and what limits them (registers,
    warps, threadgroups, smem): registers go to a warp in units of register_unit, and each
    threadgroup's shared memory takes smem_reserved more."""
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // sm["register_unit"]) * sm["register_unit"]
    limits = {"registers": sm["registers"] // (per_warp * warps), "warps": sm["warps"] // warps,
              "threadgroups": sm["threadgroups"],
              "smem": sm["smem"] // (smem + sm["smem_reserved"]) if smem else sm["threadgroups"]}
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def resource_table(jobs, arch: str = "sm_90") -> list[dict]:
    """A row per distinct CUDA module of the recorded launches `jobs`: ptxas's registers, spills
    and static shared memory (kernels.ptx.resource_usage), and at the largest threadgroup it is
    launched with, the threadgroups and warps an SM holds (occupancy: warps of the SM's 64)."""
    import kernels.runtime as rt

    largest: dict = {}
    for job in jobs:
        inst = rt.instance(job, cuda=True)
        threads = job.threadgroup[0] * job.threadgroup[1] * job.threadgroup[2]
        largest[inst] = max(threads, largest.get(inst, 0))
    rows = []
    for inst, threads in largest.items():
        use = ptx.resource_usage(inst.mlx_source(), inst.kernel_name, arch)
        groups, limiter = threadgroups_per_sm(use["registers"], threads, use["smem"])
        constants = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in inst.constants)
        rows.append(dict(kernel=inst.name, constants=constants, threads=threads, **use,
                         per_sm=groups, occupancy_pct=round(100 * groups * -(-threads // 32) / SM90["warps"]),
                         limiter=limiter))
    return rows


def write_instances(path: Path, instances) -> None:
    """Instances to a file (`lathe compile --record`): a format tag, the pickled list and the
    files their `#include` lines name (kernels.runtime.include_line: on CUDA the source MLX gets
    is such a line), gzipped. A constant that is an MLX dtype (a template type) is written by
    name: MLX's Dtype does not pickle."""
    plain = _picklable(instances)
    files = {name: Path(name).read_text() for i in plain for name in _INCLUDE.findall(i.source + i.header)}
    path.write_bytes(gzip.compress(pickle.dumps((_RECORD_FORMAT, plain, files))))


def read_instances(path: Path, source_dir: Path) -> list[Instance]:
    """write_instances' list back, its included files written into `source_dir` (this machine's
    kernels.runtime.SOURCE_DIR) under their own names (each is named by its content's digest)
    and the include lines pointed there, as this machine's launches would name them; a clear
    error for any other file."""
    try:
        tag, plain, files = pickle.loads(gzip.decompress(path.read_bytes()))
    except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{path}: not a file of `lathe compile --record` ({exc})") from None
    if tag != _RECORD_FORMAT or not all(isinstance(i, Instance) for i in plain):
        raise ValueError(f"{path}: not a file of `lathe compile --record` (format {tag!r})")
    here = {name: include_line(text, "." + ".".join(Path(name).name.split(".")[1:]), source_dir).split('"')[1]
            for name, text in files.items()}
    moved = lambda text: _INCLUDE.sub(lambda m: f'#include "{here[m.group(1)]}"', text)  # noqa: E731
    return [dataclasses.replace(i, source=moved(i.source), header=moved(i.header)) for i in _unpicklable(plain)]


def _picklable(instances) -> list[Instance]:
    """Instances whose MLX dtype constants (template types) are written by name: Dtype does not
    pickle."""
    return [dataclasses.replace(i, constants=tuple((k, (_DTYPE, dtype_name(v)) if isinstance(v, mx.Dtype) else v)
                                                   for k, v in i.constants)) for i in instances]


def _unpicklable(plain) -> list[Instance]:
    """_picklable undone."""
    dtype = lambda v: getattr(mx, v[1]) if isinstance(v, tuple) and v[:1] == (_DTYPE,) else v  # noqa: E731
    return [dataclasses.replace(i, constants=tuple((k, dtype(v)) for k, v in i.constants)) for i in plain]


_INCLUDE = re.compile(r'^#include "([^"]+\.(?:body|header)\.cuh)"$', re.M)
_RECORD_FORMAT, _DTYPE = "lathe-instances-2", "mlx.core.Dtype"
