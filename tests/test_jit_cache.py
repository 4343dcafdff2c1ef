"""The on-disk kernel cache (kernels.jit_cache) on the GPU: MLX runs the module lathe writes for a
kernel, and lathe names each module exactly as MLX does, for every kernel the checks launch."""

from __future__ import annotations

import uuid

import mlx.core as mx
import numpy as np
import pytest

from kernels import jit_cache, runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(runtime.backend() != "cuda", reason="the kernel cache is MLX's CUDA backend's")]


def _probe(name: str, body: str) -> jit_cache.Instance:
    return jit_cache.Instance(name, body, "", (("x", "float32", 1),), (("out", "float32"),),
                              (("VALUE", 1),))


def _run_probe(inst: jit_cache.Instance) -> float:
    kernel = mx.fast.cuda_kernel(name=inst.name, input_names=["x"], output_names=["out"],
                                 source=inst.source, header=inst.header)
    (out,) = kernel(inputs=[mx.zeros((1,))], template=list(inst.constants), grid=(1, 1, 1),
                    threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])
    return float(np.array(out)[0])


def test_mlx_runs_the_module_found_under_its_name():
    """A module compiled from another body (VALUE + 1), written under the name lathe computes
    for `out[0] = VALUE`, is what MLX runs: so MLX reads the cache, and the name (kernel name,
    template hash, std::hash of the generated source) is MLX's own. A control kernel with
    nothing planted computes its own body."""
    directory = jit_cache.activate()
    assert directory is not None, "the kernel cache is off on this machine"
    tag = uuid.uuid4().hex[:8]
    planted, control = _probe(f"probe_{tag}", "out[0] = VALUE;"), _probe(f"probe_c_{tag}", "out[0] = VALUE;")
    other = _probe(planted.name, "out[0] = VALUE + 1;")
    kernel = f"mlx::core::cu::{planted.kernel_name}"
    cubin, symbol = jit_cache.compile_cubin(other.mlx_source(), kernel)
    module = directory / planted.module_name()
    module.with_suffix(".txt").write_text(f"{kernel}\t{symbol}\n")
    module.with_suffix(".ptx").write_bytes(cubin)
    try:
        assert _run_probe(control) == 1.0
        assert _run_probe(planted) == 2.0, "MLX compiled the body itself: it did not find the module"
    finally:
        module.with_suffix(".txt").unlink()
        module.with_suffix(".ptx").unlink()


def _printed_source(capfd, job) -> str:
    """MLX's generated source for a launch, as its verbose mode prints it (nothing runs)."""
    capfd.readouterr()
    runtime.compile_kernel(job.spec)(
        inputs=list(job.inputs), template=list(job.constants.items()), grid=job.grid,
        threadgroup=job.threadgroup, output_shapes=[tuple(s) for s, _ in job.outputs],
        output_dtypes=[d for _, d in job.outputs], verbose=True)
    out = capfd.readouterr().out
    start = out.index("```\n") + 4
    return out[start: out.rindex("\n```")]


def test_rebuilt_source_is_mlx_source_for_every_checked_kernel(capfd):
    """For each module the checks (small cases) and the core probes launch, the source lathe
    rebuilds (and hashes, and compiles) is byte for byte the one MLX generates."""
    from harness.nvrtc import core_calls, record_launches
    from harness.suites import select

    cases = list(core_calls())
    for fam in select(None):
        cases += fam.check_cases(small=True)
    jobs = {}
    for job in record_launches(cases):
        jobs.setdefault(runtime.instance(job), job)
    assert len(jobs) > 150
    wrong = [inst.kernel_name for inst, job in jobs.items() if _printed_source(capfd, job) != inst.mlx_source()]
    assert not wrong, f"{len(wrong)} of {len(jobs)} differ, e.g. {wrong[:5]}"


def test_a_launch_writes_its_module_once():
    """The first launch of an instantiation new to the cache compiles it there, MLX loads it (the
    result is right), and a second launch leaves the file alone."""
    import dataclasses

    from kernels import loop

    assert jit_cache.activate() is not None
    k = 4096 + 8
    x = mx.array(np.random.default_rng(0).standard_normal((1, k)).astype(np.float16))
    g = mx.ones((k,), mx.float16)
    with runtime.recording() as rec:
        loop.rmsnorm(x, g, 1e-5)
    job = rec.jobs[0]  # the RMSNorm kernel under a name of its own: a module no cache holds yet
    job = dataclasses.replace(job, spec=dataclasses.replace(job.spec, name=f"{job.spec.name}_{uuid.uuid4().hex[:8]}"))
    inst = runtime.instance(job)
    assert jit_cache.cached(inst) is None
    try:
        (y,) = runtime.launch(job)
        y = np.array(y).astype(np.float64)
        path = jit_cache.cached(inst)
        assert path is not None and path.with_suffix(".txt").read_text().startswith("mlx::core::cu::")
        stamp = path.stat().st_mtime_ns
        mx.eval(runtime.launch(job))
        assert path.stat().st_mtime_ns == stamp
    finally:
        for p in jit_cache.activate().glob(f"{inst.kernel_name}_*"):
            p.unlink()
    xs = np.array(x).astype(np.float64)
    want = xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, rtol=2e-3, atol=2e-3)


def _kernel_resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, static shared bytes) of a one-kernel cubin, read from its ELF:
    EIATTR_REGCOUNT (0x2f) in .nv.info, the size of its .nv.shared.<kernel> section."""
    import struct

    headers = jit_cache.elf_sections(cubin)
    names = headers[struct.unpack_from("<H", cubin, 0x3E)[0]][4]  # e_shstrndx: the names' section
    regs, smem = [], 0
    for name_at, _, _, _, offset, size, *_ in headers:
        name = cubin[names + name_at: cubin.index(b"\0", names + name_at)].decode()
        if name.startswith(".nv.shared."):
            smem += size
        if name == ".nv.info":
            at = offset
            while at < offset + size:
                form, attr = cubin[at], cubin[at + 1]
                if form == 4:  # EIFMT_SVAL: a 2-byte length, then the value
                    length, = struct.unpack_from("<H", cubin, at + 2)
                    if attr == 0x2F:
                        regs.append(struct.unpack_from("<II", cubin, at + 4)[1])
                    at += 4 + length
                else:
                    at += 2 if form == 1 else 4
    assert len(regs) == 1, regs
    return regs[0], smem


def test_resident_is_what_the_modules_registers_allow():
    """jit_cache.resident (the driver's occupancy of a cached module, times the SMs) against a
    count of our own from the cubin's register count and shared memory and the device's limits,
    for the block launches the small checks make (their registers vary, 120-140 a thread); and
    runtime.resident_groups gives the same for the launch itself."""
    import ctypes

    from harness.nvrtc import record_launches
    from harness.suites import blocks as block_suite

    cuda, dev = jit_cache._driver(), ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), 0)

    def attribute(code: int) -> int:
        value = ctypes.c_int()
        assert cuda.cuDeviceGetAttribute(ctypes.byref(value), code, dev) == 0
        return value.value

    regs_per_sm, smem_per_sm, reserved = attribute(82), attribute(81), attribute(111)
    threads_per_sm, blocks_per_sm = attribute(39), attribute(106)
    jobs = {}
    for job in record_launches(block_suite.check_cases(small=True)):
        if "_block" in job.spec.name:
            jobs.setdefault(runtime.instance(job), job)
    assert len(jobs) >= 4
    for inst, job in jobs.items():
        threads = job.threadgroup[0]
        got = jit_cache.resident(inst, threads)
        regs, smem = _kernel_resources(jit_cache.cached(inst).read_bytes())
        # registers are allocated a warp at a time, 256 at once, from each of the SM's 4 schedulers' quarter
        warp_regs = -(-regs * 32 // 256) * 256
        warps = 4 * (regs_per_sm // 4 // warp_regs)
        want = min(warps // (threads // 32), smem_per_sm // (smem + reserved),
                   threads_per_sm // threads, blocks_per_sm) * jit_cache.sm_count()
        assert got == want, (inst.kernel_name, regs, smem, got, want)
        assert runtime.resident_groups(job) == got
