"""The kernel cache's files on any machine: long module names (a token_block's is 230 characters)
are written under names the file system takes, and a name past its limit is left to MLX."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from kernels import jit_cache, nvrtc_worker


def test_a_long_module_is_written_whole_with_no_part_left(tmp_path: Path):
    path = tmp_path / ("custom_kernel_lathe_token_block_" + "7_" * 97 + "a4de278d9ec8a664.ptx")
    assert 220 < len(path.name) <= jit_cache.NAME_MAX
    nvrtc_worker.write_module(path, "mlx::core::cu::k", "_Z1kv", b"cubin")
    assert path.read_bytes() == b"cubin"
    assert path.with_suffix(".txt").read_text() == "mlx::core::cu::k\t_Z1kv\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.with_suffix(".txt").name])


def test_a_name_past_the_limit_is_not_compiled_and_keeps_the_cache_on(tmp_path: Path, monkeypatch):
    long = str(tmp_path / ("m" * 300 + ".ptx"))
    monkeypatch.setitem(jit_cache._state, "dir", tmp_path)
    monkeypatch.setattr(jit_cache, "_job", lambda inst: ("source", "kernel", long))
    monkeypatch.setattr(jit_cache, "compile_cubin", lambda *a: pytest.fail("compiled a module MLX cannot open"))
    assert jit_cache._build(object()) is None
    assert jit_cache._state["dir"] == tmp_path  # not switched off for every other module
    assert list(tmp_path.iterdir()) == []


def test_the_compile_worker_imports_no_mlx():
    """MLX's CUDA backend takes device memory at import: 12 pytest shards with a worker a core ran
    the H100 out of memory when the worker imported it (kernels/nvrtc_worker.py)."""
    import subprocess
    import sys

    probe = "import sys, kernels.nvrtc_worker; print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == "[]"


def test_a_worker_process_compiles_its_share_and_reports_what_failed(tmp_path: Path):
    import pickle
    import subprocess
    import sys

    lib = _nvrtc_or_skip()
    good = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = 2.0f; }'
    jobs = [(good, "k", str(tmp_path / "good.ptx")), ("this is not CUDA", "k", str(tmp_path / "bad.ptx"))]
    payload = dict(nvrtc=lib._name, headers={}, options=[b"-arch=sm_90"], jobs=jobs)
    out = subprocess.run([sys.executable, "-m", "kernels.nvrtc_worker"], input=pickle.dumps(payload),
                         capture_output=True, check=True, cwd=Path(__file__).parents[1])
    good_log, bad_log = pickle.loads(out.stdout)
    assert good_log is None and "bad.cu" in bad_log
    assert (tmp_path / "good.ptx").read_bytes()[:4] == b"\x7fELF"  # a cubin
    assert (tmp_path / "good.txt").read_text() == "k\tk\n"
    assert not (tmp_path / "bad.ptx").exists()


def test_run_workers_gives_each_payload_its_result_and_none_where_a_worker_died(tmp_path: Path):
    lib = _nvrtc_or_skip()
    good = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = 2.0f; }'
    payload = dict(nvrtc=lib._name, headers={}, options=[b"-arch=sm_90"], jobs=[(good, "k", str(tmp_path / "m.ptx"))])
    assert nvrtc_worker.run_workers([payload, dict(nvrtc=lib._name)]) == [[None], None]  # no "jobs": it dies
    assert (tmp_path / "m.ptx").read_bytes()[:4] == b"\x7fELF"


class _FakeDriver:
    """libcuda's calls that jit_cache makes to load a module and ask of one function, on a CPU:
    each sets its out-argument and returns 0 (CUDA_SUCCESS) unless told to fail; `loaded` counts
    modules loaded and not unloaded, `pushed` contexts pushed and not popped, `retained` likewise."""

    def __init__(self, fail: str = ""):
        self.fail, self.loaded, self.pushed, self.retained = fail, 0, 0, 0
        self.attributes = {4: 126, 1: 33832, 3: 48}

    def _status(self, name: str) -> int:
        return 1 if name == self.fail else 0

    def cuDeviceGet(self, dev, ordinal):
        return self._status("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        self.retained += 1
        return self._status("cuDevicePrimaryCtxRetain")

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        self.retained -= 1
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self.pushed += 1
        return 0

    def cuCtxPopCurrent_v2(self, ctx):
        self.pushed -= 1
        return 0

    def cuModuleLoadData(self, module, image):
        self.loaded += 1
        return self._status("cuModuleLoadData")

    def cuModuleUnload(self, module):
        self.loaded -= 1
        return 0

    def cuModuleGetFunction(self, fn, module, name):
        return self._status("cuModuleGetFunction")

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, n, fn, threads, smem):
        n._obj.value = 4 if threads == 128 else 1
        return self._status("cuOccupancy")

    def cuFuncGetAttribute(self, value, attribute, fn):
        value._obj.value = self.attributes[attribute]
        return self._status("cuFuncGetAttribute")


@pytest.mark.parametrize("fail", ["", "cuModuleGetFunction", "cuOccupancy", "cuFuncGetAttribute"])
def test_a_module_asked_of_through_the_driver_is_let_go_again(monkeypatch, fail):
    """groups_per_sm and function_attributes load the module into the primary context, ask, and
    unload it, pop the context and release it again, also when a call fails (a RuntimeError that
    names it). No GPU: a stand-in for libcuda."""
    from kernels import jit_cache

    fake = _FakeDriver(fail)
    monkeypatch.setattr(jit_cache, "_driver", lambda: fake)
    if fail in ("", "cuOccupancy"):
        with pytest.raises(RuntimeError, match=fail) if fail else contextlib.nullcontext():
            assert jit_cache.groups_per_sm(b"cubin", "sym", 128) == 4
    if fail in ("", "cuFuncGetAttribute", "cuModuleGetFunction"):
        with pytest.raises(RuntimeError, match=fail) if fail else contextlib.nullcontext():
            assert jit_cache.function_attributes(b"cubin", "sym") == dict(registers=126, smem=33832, local_bytes=48)
    assert (fake.loaded, fake.pushed, fake.retained) == (0, 0, 0)


def test_a_cached_module_names_its_symbol(tmp_path: Path):
    from kernels import jit_cache

    path = tmp_path / "m.ptx"
    path.with_suffix(".txt").write_text("mlx::core::cu::k\t_ZN3mlx4core2cu1kEv\n")
    assert jit_cache.module_symbol(path) == "_ZN3mlx4core2cu1kEv"
    path.with_suffix(".txt").write_text("no tab here\n")
    with pytest.raises(ValueError):
        jit_cache.module_symbol(path)


# ---- native kernels' cubins on disk (kernels.native) --------------------------------------------------------
def _tiny_native(monkeypatch, tmp_path: Path, body: str = "y[threadIdx.x] = 2.0f;") -> tuple:
    """A native kernel file of its own under a stand-in kernel root, and its key."""
    from kernels import native, runtime

    (tmp_path / "k.cu").write_text('extern "C" __global__ void ENTRY(float* y) { ' + body + " }\n")
    monkeypatch.setattr(runtime, "KERNEL_ROOT", tmp_path)
    monkeypatch.setitem(jit_cache._state, "dir", tmp_path / "cache")
    native.instance.cache_clear()
    return native, ("k.cu", "lathe_k", (("A", 1),))


def _nvrtc_or_skip():
    """NVRTC's library, or the test skipped where there is none."""
    from kernels import ptx

    try:
        return ptx.nvrtc()
    except (FileNotFoundError, OSError):
        pytest.skip("no NVRTC here")


def test_native_instances_compile_ahead_in_workers_and_load_from_disk(monkeypatch, tmp_path: Path):
    """prepare() writes each missing cubin once (worker processes), the bad one's log comes back by
    symbol, and instance() then reads the file, compiling nothing."""
    _nvrtc_or_skip()
    native, key = _tiny_native(monkeypatch, tmp_path)
    other = (key[0], key[1], (("A", 2),))
    compiled, failures = native.prepare([key, other, key], workers=2)
    assert (compiled, failures) == (2, {})
    files = sorted((tmp_path / "cache" / "native").iterdir())
    assert len(files) == 2 and all(f.read_bytes()[:4] == b"\x7fELF" for f in files)
    assert native.prepare([key, other]) == (0, {})  # there already
    monkeypatch.setattr(native, "cubin", lambda *a: pytest.fail("compiled a cached instance"))
    assert native.instance(*key) == ("lathe_k_a1", native._cache_file(*key).read_bytes())
    (tmp_path / "k.cu").write_text('extern "C" __global__ void ENTRY(float* y) { this is not CUDA }\n')
    compiled, failures = native.prepare([key])  # an edited source is another file
    assert compiled == 1 and "k.cu" in failures["lathe_k_a1"]


def test_a_native_launch_in_a_kept_recording_is_noted_not_compiled(monkeypatch, tmp_path: Path):
    import mlx.core as mx

    from kernels import runtime

    native, key = _tiny_native(monkeypatch, tmp_path)
    monkeypatch.setattr(native, "cubin", lambda *a: pytest.fail("compiled while noting"))
    with runtime.recording(keep_prepared=True) as rec:
        (y,) = native.launch(key[0], key[1], dict(key[2]), [], [((32,), mx.float32)], (32, 1, 1), (32, 1, 1), 0)
    assert rec.native == [key] and y.shape == (32,)
    assert runtime.native_sink() is None  # closed with the recording


def test_the_native_cache_file_follows_the_source_and_constants(monkeypatch, tmp_path: Path):
    _nvrtc_or_skip()
    native, key = _tiny_native(monkeypatch, tmp_path)
    first = native._cache_file(*key)
    assert first.parent == tmp_path / "cache" / "native" and first.name.startswith("lathe_k-")
    assert native._cache_file(key[0], key[1], (("A", 2),)) != first
    (tmp_path / "k.cu").write_text((tmp_path / "k.cu").read_text() + "// edited\n")
    assert native._cache_file(*key) != first
    (tmp_path / "k.cu").write_text('#include "other.h"\n' + (tmp_path / "k.cu").read_text())
    assert native._cache_file(*key) is None  # what it includes is not in the digest
    monkeypatch.setitem(jit_cache._state, "dir", None)
    assert native._cache_file(*key) is None  # the cache off: each process compiles
