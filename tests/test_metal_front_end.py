"""`lathe compile --metal`: every instantiation the checks launch, as the Metal source that
mx.fast.metal_kernel builds, through clang's C++17 front end over lathe's model of Metal
(kernels/msl/metal_model). The check rejects what Metal rejects: the tests below show it failing
on each kind of mistake, beside a clean twin that passes (CPU; needs the libclang package)."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("clang.cindex", reason="the Metal front-end check needs the libclang package")

from harness.metal import front_end_errors, metal_source  # noqa: E402

CLEAN = """const uint i = thread_position_in_grid.x;
threadgroup float scratch[32];
scratch[thread_index_in_simdgroup] = float(x[i]);
threadgroup_barrier(mem_flags::mem_threadgroup);
const half2 h = half2(half(simd_sum(scratch[0])), half(1.0f));
const float v = float(h.x) * float(dims[0]);
y[i] = half(v) + as_type<half2>(load_wide<uint>(x, i)).y;
"""


def _errors(extra: str = "", clean: str = CLEAN) -> list[str]:
    # x: 64 halves (device memory), dims: 3 int32 (under 8 elements: constant memory), y: output
    src = metal_source("probe", clean + extra, '#include "lathe.h"',
                       [("x", mx.float16, (64,)), ("dims", mx.int32, (3,))], [("y", mx.float16)], {"N": 4})
    return front_end_errors(src.replace('#include "lathe.h"', _lathe_h()))


def _lathe_h() -> str:
    from kernels.runtime import MSL_DIR

    return (MSL_DIR / "lathe.h").read_text()


def test_a_clean_body_passes():
    assert _errors() == []
    # casts that keep the address space are Metal's own (lathe.h's wide loads are made of them)
    assert _errors("const device uint* w = (const device uint*)x;\n"
                   "threadgroup uint* u = (threadgroup uint*)scratch;\n") == []


@pytest.mark.parametrize("mistake, message", [
    ("__syncthreads();", "__syncthreads"),  # CUDA, not Metal
    ("const half h2 = __float2half(1.0f);", "__float2half"),
    ("const uint s = __shfl_xor_sync(0xffffffffu, 1u, 1);", "__shfl_xor_sync"),
    ("half* p = x;", "cannot initialize"),  # a device pointer losing its address space
    ("threadgroup half* t = y;", "cannot initialize"),  # device memory as threadgroup memory
    ("device int32_t* d = writable(dims);", "writable"),  # dims is in constant memory
    ("atomic_fetch_add_explicit((device atomic_uint*)y, 1u, memory_order_acq_rel);", "memory_order_acq_rel"),
    ("const float z = exp(1.0f, 2.0f);", "exp"),
    # C-style casts that move a pointer to another address space, which C++ takes and Metal not
    ("threadgroup float* t = (threadgroup float*)x;", "changes the address space"),
    ("const float* t = (const float*)x;", "changes the address space"),  # device to thread
    ("device float* d = (device float*)scratch;", "changes the address space"),  # a threadgroup array
])
def test_what_metal_rejects_is_rejected(mistake, message):
    errors = _errors(mistake + "\n")
    assert errors and any(message in e for e in errors), errors


def test_every_instantiation_the_checks_launch_passes(capsys):
    """The whole sweep (`lathe compile --metal`): each distinct source of the small check cases'
    launches, every family."""
    from harness.cli import cmd_compile_metal

    assert cmd_compile_metal(None) == 0, capsys.readouterr().out[-3000:]
    assert " 0 failed" in capsys.readouterr().out


# CUDA's own device functions that stand for the MSL ones of the same name and meaning (float
# overloads): cuda_compat.h needs no mapping for them
CUDA_NAMES = {"cos", "sin", "exp", "exp2", "fabs", "floor", "fma", "max", "min", "pow", "rsqrt", "tanh", "trunc"}
_NOT_FUNCTIONS = {"__attribute__", "address_space", "ext_vector_type", "static_assert", "__builtin_bit_cast",
                  "sizeof", "decltype", "operator", "vec", "elements", "thread_elements"}


def _model_functions() -> set[str]:
    import re

    from kernels.runtime import MSL_DIR

    text = "".join(re.sub(r"//[^\n]*", "", p.read_text()) for p in (MSL_DIR / "metal_model").iterdir())
    return {n for n in re.findall(r"\b([a-z_][a-z0-9_]*)\s*\(", text) if n not in _NOT_FUNCTIONS}


def test_the_model_and_the_compat_header_cover_one_subset():
    """The model of Metal declares the MSL functions that the bodies and lathe.h use, and no
    others; each one the portable code uses (the bodies, and lathe.h outside its Metal branch)
    is provided on CUDA: named in cuda_compat.h, or one of CUDA's own (CUDA_NAMES)."""
    import re

    from kernels.runtime import KERNEL_ROOT, MSL_DIR

    def names(text: str) -> set[str]:
        return set(re.findall(r"\b[A-Za-z_]\w*\b", re.sub(r"//[^\n]*", "", text)))

    lathe = (MSL_DIR / "lathe.h").read_text()
    metal_branch = lathe[lathe.index("#ifdef __METAL_VERSION__"):lathe.index("#endif")]
    portable = names("".join(p.read_text() for p in KERNEL_ROOT.glob("*/*.metal")) + lathe.replace(metal_branch, ""))
    model = _model_functions()
    assert CUDA_NAMES <= model
    assert model <= portable | names(metal_branch), f"declared and never used: {sorted(model - portable - names(metal_branch))}"
    compat = names((MSL_DIR / "cuda_compat.h").read_text())
    missing = sorted(n for n in model & portable if n not in compat | CUDA_NAMES)
    assert not missing, f"used by the bodies, declared by the model, not provided on CUDA: {missing}"


def test_every_spec_counts_its_threadgroup_memory_and_names_what_it_writes_in_place():
    """What kernels.runtime.check_launch holds to the budget before a launch (each spec's
    threadgroup_bytes) is what the instantiated source declares, measured by the front end, for
    every distinct instantiation the small check cases launch for CUDA: its own geometry, and the
    seam and the decoder blocks as one launch each, which Metal's sweep (`lathe compile --metal`,
    the test above, which makes the same comparison) does not see. And each fits CUDA's budget.
    The inputs each spec says it writes in place (`in_place`, which launches check) are the
    parameters its compiled code writes through, read from clang's AST (so a write an `#if`
    removes does not count)."""
    from harness.metal import front_end, launch_source, threadgroup_bytes_mismatch, written_in_place
    from harness.nvrtc import core_calls, record_launches
    from harness.suites import select
    from kernels.backends import THREADGROUP_MEMORY

    cases = list(core_calls()) + [c for fam in select(None) for c in fam.check_cases(small=True)]
    jobs = {(job.spec.name, tuple(job.constants.items())): job for job in record_launches(cases, target="cuda")}
    assert any(job.spec.name.startswith("lathe_layer_block") for job in jobs.values())
    assert any(job.spec.name.startswith("lathe_seam") for job in jobs.values())
    wrong, largest, writers = [], 0, 0
    for job in jobs.values():
        source = launch_source(job)
        measured = front_end(source)[1]
        largest = max(largest, measured)
        if (mismatch := threadgroup_bytes_mismatch(job, measured)) is not None:
            wrong.append(f"{job.spec.name}: {mismatch}")
        if "writable(" in source.split("[[kernel]]", 1)[1]:  # the body (lathe.h defines it)
            written = written_in_place(source)
            writers += bool(written)
            if written != set(job.spec.in_place):
                wrong.append(f"{job.spec.name}: writes {sorted(written)} in place, says {job.spec.in_place}")
        elif job.spec.in_place:
            wrong.append(f"{job.spec.name}: says it writes {job.spec.in_place} in place, and writes nothing")
    assert not wrong, "\n".join(wrong[:10])
    assert 0 < largest <= THREADGROUP_MEMORY["cuda"] and writers > 10


def test_a_launch_past_the_budget_is_refused_before_it_is_made():
    """A spec that counts more threadgroup memory than the target gives, or threadgroups past its
    threads, is refused with the numbers before anything is recorded or launched; the same
    launch within the budget goes through."""
    from kernels.runtime import LaunchLimitError
    from kernels.runtime import KernelSpec, Launch, launch, recording

    spec = KernelSpec("lathe_test_budget", "loop/rmsnorm.metal", ("x", "gamma", "dims", "eps"), ("y",),
                      prelude="#define LATHE_RESIDUAL 0", threadgroup_bytes=lambda c: 4 * c["NSIMD"])
    inputs = [mx.zeros((1, 64), mx.float16), mx.zeros((64,), mx.float16), mx.zeros((2,), mx.int32),
              mx.zeros((1,), mx.float32)]
    for target, fits, past in (("metal", 8192, 8193), ("cuda", 12288, 12289)):
        with recording(target) as rec:
            launch(Launch(spec, inputs, [((1, 64), mx.float16)], (32, 1, 1), (32, 1, 1), dict(NSIMD=fits)))
            with pytest.raises(LaunchLimitError, match=rf"{4 * past} bytes of threadgroup memory, past the"):
                launch(Launch(spec, inputs, [((1, 64), mx.float16)], (32, 1, 1), (32, 1, 1), dict(NSIMD=past)))
            with pytest.raises(LaunchLimitError, match="threadgroups of 2048 threads"):
                launch(Launch(spec, inputs, [((1, 64), mx.float16)], (2048, 1, 1), (2048, 1, 1), dict(NSIMD=1)))
        assert len(rec.jobs) == 1
    with recording("metal") as rec:  # Metal's 256 threads, which CUDA's launches may pass
        with pytest.raises(LaunchLimitError, match="threadgroups of 512 threads, past the 256"):
            launch(Launch(spec, inputs, [((1, 64), mx.float16)], (512, 1, 1), (512, 1, 1), dict(NSIMD=16)))
    assert not rec.jobs


def test_decode_attention_splits_a_wide_group_to_fit_the_budget():
    """Multi-query heads (32 query heads on one kv head, D = 256) would need more threadgroup
    memory a threadgroup than Metal's 32 KiB and CUDA's 48 KiB: the wrapper gives a threadgroup
    fewer of the heads (a larger query split) until its launch fits, on either target."""
    from kernels import attention, options
    from kernels.backends import THREADGROUP_MEMORY
    from kernels.runtime import recording

    q = mx.zeros((1, 32, 256), mx.float16)
    cache = mx.zeros((1, 1, 64, 256), mx.float16)
    assert attention.decode_threadgroup_bytes(32, 256, attention.NSIMD, False, 0) > THREADGROUP_MEMORY["cuda"]
    for target, heads in (("metal", 8), ("cuda", 16)):  # the most heads a threadgroup fits
        # attn_query_split 1: no split for the grid's sake, so only the budget splits the group
        with recording(target) as rec, options.use(attn_query_split=1):
            attention.flash_decode(q, cache, cache, [40], 0.1)
        (job,) = rec.jobs
        c = job.constants
        assert (c["G"], c["QS"]) == (heads, 32 // heads)
        assert job.spec.threadgroup_bytes(c) <= THREADGROUP_MEMORY[target]
