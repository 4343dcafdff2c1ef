"""Every kernel instantiation compiles with NVRTC as MLX's CUDA backend would compile it: runs
where NVRTC and the CUDA headers are found (a developer machine with the CUDA toolkit), skipped
with the reason elsewhere. It needs no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.nvrtc import compile_all, core_calls, record_instantiations
from harness.suites.rope import check_cases
from kernels import ptx


def _available() -> str:
    try:
        ptx.nvrtc(), ptx.include_dirs()
    except (FileNotFoundError, OSError) as exc:
        return str(exc)
    return ""


@pytest.mark.skipif(bool(_available()), reason=_available() or "available")
def test_every_instantiation_compiles_with_nvrtc():
    insts = record_instantiations(core_calls() + check_cases(small=True))
    assert len(insts) > 50  # every constant combination the checks launch, plus the probes
    failures = compile_all(insts)
    assert not failures, "\n\n".join(f"{name}\n{log[:2000]}" for name, log in failures)


@pytest.mark.skipif(bool(_available()), reason=_available() or "available")
def test_ptx_has_the_unmangled_kernel_symbol():
    """The ptx launch path finds the kernel by its name: extern "C" keeps it unmangled."""
    from kernels.jit_cache import Instance

    inst = Instance("lathe_probe", "out[0] = in[0] + N;", "", (("in", "int32", 1),),
                    (("out", "int32"),), (("N", 1),))
    src = inst.mlx_source().replace("__global__ void", 'extern "C" __global__ void', 1)
    text = ptx.compile_ptx(src, inst.kernel_name).decode()
    assert f".entry {inst.kernel_name}(" in text
    with pytest.raises(ptx.CompileError, match="undefined"):
        ptx.compile_ptx(src.replace("in[0]", "nowhere[0]"), "broken")


@pytest.mark.skipif(bool(_available()), reason=_available() or "available")
def test_launch_bounds_in_the_header_reach_the_kernel():
    """kernels.runtime.bounds_lines: the header's redefined __global__ bounds MLX's kernel, whose
    name the header does not know (PTX's .maxntid and .minnctapersm)."""
    from kernels.jit_cache import Instance
    from kernels.runtime import bounds_lines

    inst = Instance("lathe_probe", "out[0] = in[0] + N;", bounds_lines(128, 4), (("in", "int32", 1),),
                    (("out", "int32"),), (("N", 1),))
    src = inst.mlx_source().replace("__global__ void", 'extern "C" __global__ void', 1)
    text = ptx.compile_ptx(src, inst.kernel_name).decode()
    assert ".maxntid 128, 1, 1" in text and ".minnctapersm 4" in text
    with pytest.raises(ValueError, match="launch bounds"):
        bounds_lines(128, 0)


ONE_CASE = "rope_neox[table](seq=1,head_dim=64,n_heads=32,n_kv_heads=32,pos=0,"  # one whole-size check case (recording many is slow on a CPU)


def test_compile_records_modules_to_a_file_that_a_cuda_machine_compiles(tmp_path, capsys):
    """`lathe compile --record F` (any machine): the modules of the whole check's cases, written
    for `--recorded F` on a CUDA machine, which then records nothing; anything else in F is a clear
    error, and `--recorded` without CUDA says what it needs. No NVRTC, no GPU."""
    from harness.cli import cmd_compile
    from harness import nvrtc
    from harness.nvrtc import record_instantiations
    from harness.suites import select
    from kernels import runtime

    path = tmp_path / "modules.gz"
    assert cmd_compile("rope", ONE_CASE, record=str(path)) == 0
    assert f"into {path}" in capsys.readouterr().out
    cases = core_calls() + [c for fam in select("rope") for c in fam.check_cases(small=False) if ONE_CASE in c.id]
    recorded = record_instantiations(cases)
    assert nvrtc.read_instances(path, runtime.SOURCE_DIR) == recorded
    # where this machine keeps kernel sources elsewhere, the included files are written there
    # (same names: each is its content's digest) and the include lines point there
    elsewhere = tmp_path / "sources"
    moved = nvrtc.read_instances(path, elsewhere)
    assert len(moved) == len(recorded) and any(i.source.startswith("#include") for i in recorded)
    for old, new in zip(recorded, moved):
        assert (new.name, new.inputs, new.outputs, new.constants) == (old.name, old.inputs, old.outputs, old.constants)
        for a, b in ((old.source, new.source), (old.header, new.header)):
            if a.startswith("#include"):
                was, now = (Path(t.split('"')[1]) for t in (a, b))
                assert now.parent == elsewhere and now.name == was.name and now.read_text() == was.read_text()
            else:
                assert a == b
    # a template type among the constants (MLX's Dtype does not pickle) comes back as itself
    import mlx.core as mx
    from kernels.jit_cache import Instance

    typed = Instance("lathe_probe", "out[0] = in[0];", "", (("in", "float16", 1),), (("out", "float16"),),
                     (("T", mx.float16), ("N", 3)))
    nvrtc.write_instances(tmp_path / "typed", [typed])
    assert nvrtc.read_instances(tmp_path / "typed", runtime.SOURCE_DIR) == [typed]
    (tmp_path / "other").write_bytes(b"not a list of modules")
    with pytest.raises(ValueError, match="not a file of `lathe compile --record`"):
        nvrtc.read_instances(tmp_path / "other", runtime.SOURCE_DIR)
    if runtime.backend() != "cuda":
        assert cmd_compile(None, recorded=str(path)) == 2
        assert "needs MLX's CUDA backend" in capsys.readouterr().out


def test_recording_in_worker_processes_gives_what_one_process_records():
    """`lathe compile` records the whole check in worker processes (each a share of the cases):
    the same modules in the same first-launch order as one process, template types included."""
    from harness.nvrtc import compile_cases, record_in_parallel

    one = record_instantiations(compile_cases(["loop"], small=True))  # the core calls, then loop's
    assert len(one) > 10 and any(not isinstance(v, (int, float, str, bool)) for i in one for _, v in i.constants)
    assert record_in_parallel(["loop"], small=True, workers=3) == one
    assert record_in_parallel(["loop"], small=True, match="argmax_float16", workers=2) == \
        record_instantiations(compile_cases(["loop"], small=True, match="argmax_float16"))


PTXAS_LOG = """ptxas info    : 5987 bytes gmem
ptxas info    : Compiling entry function '_ZN3mlx4core2cu9custom_kernel_lathe_qmm_split' for 'sm_90'
ptxas info    : Function properties for _ZN3mlx4core2cu9custom_kernel_lathe_qmm_split
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 194 registers, used 1 barriers, 16384 bytes smem
"""


def test_ptxas_verbose_log_is_read():
    assert ptx.parse_ptxas(PTXAS_LOG) == dict(registers=194, stack=8, spill_stores=4, spill_loads=12, smem=16384)
    assert ptx.parse_ptxas(PTXAS_LOG.replace(", 16384 bytes smem", ""))["smem"] == 0  # none declared
    with pytest.raises(ptx.CompileError, match="no ptxas register count"):
        ptx.parse_ptxas("ptxas info    : 0 bytes gmem")


@pytest.mark.parametrize("registers, threads, smem, held", [
    (92, 128, 4096, (5, "registers")),  # qmm at 16 rows: ncu's 5 threadgroups an SM (62da84b)
    (194, 128, 16384, (2, "registers")),  # at 64 rows: 8 warps of 64, ncu's 11% achieved
    (16, 128, 48 * 1024, (4, "smem")),  # 48 KB each, and 1 KB the SM keeps a threadgroup
    (32, 1024, 0, (2, "registers")),  # 32 warps a threadgroup: registers and warps both allow 2
    (16, 32, 0, (32, "threadgroups"))])
def test_threadgroups_an_sm_holds(registers, threads, smem, held):
    from harness.nvrtc import threadgroups_per_sm

    assert threadgroups_per_sm(registers, threads, smem) == held


@pytest.mark.skipif(bool(_available()), reason=_available() or "available")
def test_resource_table_reports_what_ptxas_gives():
    """ptxas's own figures through NVRTC: a qmm of 64 rows holds more accumulators (and
    registers) than one of 16, and the table's occupancy follows from them."""
    import mlx.core as mx

    from harness.nvrtc import SM90, record_launches, resource_table
    from kernels import gemv
    from reference import formats

    w = gemv.repack(mx.zeros((512, formats.row_bytes("Q4_0", 1024)), mx.uint8), "q4_0", 512, 1024)

    class Case:  # record_launches takes check cases: anything with run(rng)
        def __init__(self, m):
            self.m = m

        def run(self, rng):
            gemv.qmm(mx.zeros((self.m, 1024), mx.float16), w, "q4_0", 512, 1024, ks=1)

    rows = {r["constants"].split(" M=")[1].split()[0]: r for r in resource_table(record_launches([Case(16), Case(64)], "cuda"))}
    assert set(rows) == {"16", "64"}
    assert 0 < rows["16"]["registers"] < rows["64"]["registers"] <= SM90["max_registers"]
    for r in rows.values():
        assert r["kernel"] == "lathe_qmm" and r["per_sm"] >= 1 and r["limiter"] in ("registers", "warps", "smem")
        assert r["occupancy_pct"] == round(100 * r["per_sm"] * r["threads"] // 32 / SM90["warps"])
