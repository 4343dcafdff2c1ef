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
