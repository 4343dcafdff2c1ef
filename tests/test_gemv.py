"""Quantized GEMV: argument checks (CPU), the formats' reference self-checks (CPU), and every
check case against float64 on dequantized weights or the reference bytes (GPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import gemv, options
from tests.test_nvrtc_compile import _available as _nvrtc_missing

N, K = 8, 64


def x16(m=1, k=K):
    return mx.zeros((m, k), mx.float16)


def w8(nbytes):
    return mx.zeros((nbytes,), mx.uint8)


def _bad_inputs(fn):
    return [
        (lambda: fn(x16(k=40), w8(N * 40), "q4_0", N, 40), "multiple of 32"),
        (lambda: fn(mx.zeros((1, K)), w8(N * 36), "q4_0", N, K), "float16"),
        (lambda: fn(x16(5), w8(N * 36), "q4_0", N, K), "M in 1..4"),
        (lambda: fn(x16(k=96), w8(N * 36), "q4_0", N, K), r"\[M, 64\]"),
        (lambda: fn(x16(), w8(N * 36 + 1), "q4_0", N, K), "takes 288"),
        (lambda: fn(x16(), w8(N * 36), "q8_0", N, K), "takes 544"),
        (lambda: fn(x16(), mx.zeros((N * 36,), mx.int8), "q4_0", N, K), "uint8"),
        (lambda: fn(x16(), w8(N * 36), "q2_k", N, K), "qtype"),
        (lambda: fn(x16(), w8(0), "q4_0", 0, K), "N must be positive"),
    ]


def _seam(x=None, w_b=None, residual=None, gamma=None, eps=1e-5, queue=None, swiglu=False, **knobs):
    """A seam of A = [32, K] and B = [N, 32] (Q4_0), with the arguments given made wrong."""
    return gemv.seam(x16() if x is None else x, w8(32 * 36), 32, K,
                     x16(1, 32) if residual is None else residual, x16(k=32)[0] if gamma is None else gamma,
                     eps, w8(N * 18) if w_b is None else w_b, N, "q4_0", swiglu=swiglu, queue=queue, **knobs)


BAD = [
    *_bad_inputs(gemv.gemv_v1),
    *_bad_inputs(gemv.gemv_v2),
    (lambda: gemv.gemv_v2(x16(), w8(N * 36), "q4_0", N, K, rows=32, simds=8), "threadgroup memory"),
    (lambda: gemv.rmsnorm_gemv(x16(), x16(k=K)[0, :32], 1e-5, w8(N * 36), "q4_0", N, K), "gamma must be"),
    (lambda: gemv.rmsnorm_gemv(x16(), mx.zeros((K,)), 1e-5, w8(N * 36), "q4_0", N, K), "gamma must be float16"),
    (lambda: gemv.rmsnorm_gemv(x16(), x16()[0], 0.0, w8(N * 36), "q4_0", N, K), "eps"),
    (lambda: gemv.silu_down_gemv(x16(), w8(N * 36), "q4_0", N, K), r"\[M, 128\]"),
    (lambda: _seam(x=x16(k=2 * K)), r"\[M, 64\]"),
    (lambda: _seam(x=x16(k=K), swiglu=True), r"\[M, 128\]"),
    (lambda: _seam(w_b=w8(N * 36)), "takes 144"),
    (lambda: _seam(residual=x16(2, 32)), r"residual must be \[M=1, N=32\]"),
    (lambda: _seam(gamma=x16(k=K)[0]), r"gamma must be \[K=32\]"),
    (lambda: _seam(eps=0.0), "eps"),
    (lambda: _seam(queue=mx.zeros((gemv.SEAM_QUEUE,), mx.int32)), "queue must be uint32"),
    (lambda: _seam(queue=mx.zeros((4,), mx.uint32)), "queue must be uint32"),
    (lambda: _seam(launched=0), "launched must be at least"),
    (lambda: _seam(groups=3), "unknown launch knobs"),
    (lambda: gemv.linear(x16(9, k=32), w8(N * 36), "q4_0", N, K), r"M >= 1"),
    (lambda: gemv.quantize(mx.zeros((4, 64)), "q4_0"), "float16"),
    (lambda: gemv.quantize(mx.zeros((4, 48), mx.float16), "q4_0"), "multiple of 32"),
    (lambda: gemv.quantize(mx.zeros((64,), mx.float16), "q8_0"), r"\[N, K\]"),
    (lambda: gemv.dequantize(w8(N * 36 - 2), "q4_0", N, K), "takes 288"),
    (lambda: gemv.split(x16(1, 10), (4, 4)), "add up"),
]


def _packed(qtype="q4_0", n=N, k=K):
    return gemv.Packed(w8(n * k // 32 * gemv.QTYPES[qtype][1]), qtype, n, k)


BAD += [
    (lambda: gemv.gemv_v3(x16(), w8(N * 36), "q4_0", N, K), "Packed"),  # GGUF blocks to v3
    (lambda: gemv.gemv_v2(x16(), _packed(), "q4_0", N, K), "GGUF blocks"),  # and the other way
    (lambda: gemv.gemv_v3(x16(), _packed(), "q8_0", N, K), r"packed weights are q4_0 \[N=8, K=64\]"),
    (lambda: gemv.gemv_v3(x16(), _packed(n=2 * N), "q4_0", N, K), r"packed weights are q4_0 \[N=16"),
    (lambda: gemv.gemv_v3(x16(5), _packed(), "q4_0", N, K), "M in 1..4"),
    (lambda: gemv.gemv_v3(x16(), _packed(), "q4_0", N, K, slots=2), "unknown launch knobs"),
    (lambda: gemv.gemv_v3(x16(), _packed(), "q4_0", N, K, max_groups=-1), "max_groups"),
    (lambda: gemv.gemv_v3(x16(), gemv.Packed(w8(N * 36 - 2), "q4_0", N, K), "q4_0", N, K), "takes 288"),
    (lambda: gemv.rmsnorm_gemv(x16(), x16()[0], 0.0, _packed(), "q4_0", N, K), "eps"),
    (lambda: gemv.silu_down_gemv(x16(), _packed(), "q4_0", N, K), r"\[M, 128\]"),
    (lambda: gemv.repack(w8(N * 36 + 2), "q4_0", N, K), "takes 288"),
    (lambda: gemv.gate_up_swiglu(x16(), w8(N * 36), "q4_0", N, K), "repacked weights"),
    (lambda: gemv.gate_up_swiglu(x16(), _packed(n=7), "q4_0", 7, K), "even number of rows"),
    (lambda: gemv.gate_up_swiglu(x16(), _packed(), "q4_0", N, K, gamma=x16()[0]), "both gamma and eps"),
    (lambda: gemv.gate_up_swiglu(x16(), _packed(), "q4_0", N, K, gamma=x16()[0], eps=0.0), "eps"),
    (lambda: gemv.gate_up_swiglu(x16(), _packed(), "q4_0", N, K, rows=3), "rows must be even"),
    (lambda: gemv.gate_up_swiglu(x16(k=2 * K), _packed(), "q4_0", N, K), r"\[M, 64\]"),
]


@pytest.mark.parametrize("qtype", gemv.QTYPES)
@pytest.mark.parametrize("n, k", [(1, 32), (33, 4128), (7, 96)])
def test_repack_keeps_every_weight(qtype, n, k):
    """The load-time layout decodes (from its own definition, reference.quant) to the weights of
    the GGUF blocks it came from, and unpacks to those very bytes."""
    import numpy as np

    from reference.quant import dequantize, dequantize_packed, quantize

    blocks = quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), qtype)
    packed = gemv.repack(mx.array(blocks), qtype, n, k)
    assert (packed.qtype, packed.n, packed.k) == (qtype, n, k) and packed.data.size == blocks.size
    assert np.array_equal(dequantize_packed(np.array(packed.data), qtype, n, k), dequantize(blocks, qtype, k))
    assert np.array_equal(np.array(gemv.unpack(packed)), blocks)


@pytest.mark.parametrize("qtype", list(gemv.K_QTYPES))
def test_k_quant_repack_is_the_reference_layout(qtype, monkeypatch):
    """The device repack of the K-quants (MLX ops; here on the CPU) makes reference.kquant.pack's
    bytes, in steps of rows as on the device (REPACK_ROWS, a last step short)."""
    import numpy as np

    from reference import kquant

    monkeypatch.setattr(gemv, "REPACK_ROWS", 2)
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (5, 768 // 256 * kquant.BLOCK_BYTES[qtype]), dtype=np.uint8)
    packed = gemv.repack(mx.array(blocks), qtype, 5, 768)
    assert (packed.qtype, packed.n, packed.k) == (qtype, 5, 768)
    assert np.array_equal(np.array(packed.data), kquant.pack(blocks, qtype, 5, 768))
    with pytest.raises(ValueError, match="Q4_0/Q8_0"):
        gemv.unpack(packed)


@pytest.mark.parametrize("qtype", list(gemv.LEGACY_QTYPES))
def test_legacy_repack_is_the_reference_layout(qtype):
    """The device repack of Q4_1, Q5_0, Q5_1 (MLX ops; here on the CPU) makes
    reference.quant.pack_legacy's bytes, on random blocks (every fifth-bit pattern)."""
    from reference import quant

    blocks = np.random.default_rng(8).integers(0, 256, (5, 96 // 32 * gemv.LEGACY_QTYPES[qtype][1]), dtype=np.uint8)
    packed = gemv.repack(mx.array(blocks), qtype, 5, 96)
    assert (packed.qtype, packed.n, packed.k) == (qtype, 5, 96)
    assert np.array_equal(np.array(packed.data), quant.pack_legacy(blocks, qtype, 5, 96))
    with pytest.raises(ValueError, match="repacked weights only"):
        gemv.gemv_v2(mx.zeros((1, 96), mx.float16), mx.array(blocks), qtype, 5, 96)


@pytest.mark.parametrize("qtype", list(gemv.IQ4_QTYPES))
def test_iq4_repack_is_the_reference_layout(qtype):
    """The device repack of IQ4_NL and IQ4_XS (MLX ops; here on the CPU) makes reference.iquant.pack's
    bytes; their GGUF blocks go to no v1/v2 GEMV."""
    from reference import iquant

    _, per_block, bb = gemv.IQ4_QTYPES[qtype]
    blocks = np.random.default_rng(9).integers(0, 256, (5, 512 // per_block * bb), dtype=np.uint8)
    packed = gemv.repack(mx.array(blocks), qtype, 5, 512)
    assert np.array_equal(np.array(packed.data), iquant.pack(blocks, qtype, 5, 512))
    with pytest.raises(ValueError, match="repacked weights only"):
        gemv.gemv_v2(mx.zeros((1, 512), mx.float16), mx.array(blocks), qtype, 5, 512)


def test_k_quants_take_the_v3_path_only():
    """A K-quant matrix in GGUF blocks (v1/v2) or with rows not of whole super-blocks: a clear
    error before any launch."""
    x = mx.zeros((1, 256), mx.float16)
    w = mx.zeros((4, 144), mx.uint8)
    with pytest.raises(ValueError, match="repacked weights only"):
        gemv.gemv_v2(x, w, "q4_k", 4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        gemv.repack(mx.zeros((4, 144), mx.uint8), "q4_k", 8, 128)
    with pytest.raises(ValueError, match="repacked weights only"):
        gemv.seam(x, w, 4, 256, mx.zeros((1, 4), mx.float16), mx.zeros((4,), mx.float16), 1e-5, w, 4, "q4_k")


def test_v3_geometry_fits_and_streams():
    for qtype in gemv.QTYPES:
        for m in range(1, gemv.MAX_M + 1):
            for n, k in ((1, 32), (1024, 4096), (4096, 14336), (151936, 1024), (7, 40960)):
                r, s, p, xchunk = gemv.v3_geometry(qtype, m, n, k)
                assert gemv.v3_smem_bytes(m, xchunk, s) <= gemv.SMEM_BUDGET
                assert r >= 1 and s >= 1 and p >= 1 and xchunk % 32 == 0 and 0 < xchunk <= k
                assert xchunk == k or xchunk % 2048 == 0
    assert gemv.v3_geometry("q4_0", 1, 4096, 14336)[3] == 14336  # M = 1: all of K at once
    assert gemv.v3_geometry("q4_0", 4, 4096, 14336)[3] == 4096   # four rows of X: in chunks


@pytest.mark.parametrize("call, message", BAD)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_quantize_refuses_nan_before_launch():
    if not __import__("kernels.runtime", fromlist=["has_gpu"]).has_gpu():
        pytest.skip("the finiteness check evaluates on the device")
    with pytest.raises(ValueError, match="NaN"):
        gemv.quantize(mx.array([[float("nan")] + [0.0] * 31], mx.float16), "q4_0")


def test_geometry_fits_and_spreads():
    for qtype in gemv.QTYPES:
        for m in range(1, gemv.MAX_M + 1):
            for n, k in ((1, 32), (1024, 4096), (4096, 14336), (151936, 1024), (7, 40960)):
                r, s, xchunk, slots = gemv.v2_geometry(qtype, m, n, k)
                assert gemv.v2_smem_bytes(qtype, m, r, s, xchunk, slots) <= gemv.SMEM_BUDGET
                assert r >= 1 and s >= 1 and xchunk % 2048 == 0 and xchunk >= 2048
                assert xchunk <= max(2048, -(-k // 2048) * 2048)
    # a small matrix gets more, smaller threadgroups than a large one; K = 4096 is one chunk
    small, large = gemv.v2_geometry("q4_0", 1, 1024, 4096), gemv.v2_geometry("q4_0", 1, 14336, 4096)
    assert small[0] * small[1] < large[0] * large[1]
    assert gemv.v2_geometry("q4_0", 1, 14336, 4096)[2] == 4096


def test_tuned_slots_only_where_all_of_k_fits_one_chunk():
    saved = gemv.TUNING["q4_0"]["SLOTS"], gemv.TUNING["q8_0"]["SLOTS"]
    try:
        gemv.set_tuning("SLOTS=2")
        # gate+up (K 4096): two slots beside all of K; down (K 14336): the register path, one
        # chunk of 12288 as before, rather than slots and an X cut in four
        assert gemv.v2_geometry("q4_0", 1, 28672, 4096)[2:] == (4096, 2)
        assert gemv.v2_geometry("q4_0", 1, 4096, 14336)[2:] == (12288, 0)
        # a value given for one launch is kept, the chunk shrinks for it
        assert gemv.v2_geometry("q4_0", 1, 4096, 14336, slots=2)[2:] == (4096, 2)
        # unaligned rows never take slots
        assert gemv.v2_geometry("q4_0", 1, 4096, 4096 + 32)[3] == 0
    finally:
        gemv.TUNING["q4_0"]["SLOTS"], gemv.TUNING["q8_0"]["SLOTS"] = saved
        gemv.v2_geometry.cache_clear()


def test_tuning_text_takes_every_knob_and_names_them_when_wrong():
    assert gemv.parse_tuning("R=4, SLOTS=2,SEAM_PREFETCH=0") == {"R": 4, "SLOTS": 2, "SEAM_PREFETCH": 0}
    assert gemv.parse_tuning("DEQUANT_SPLIT=1") == {"DEQUANT_SPLIT": 1}
    with pytest.raises(ValueError, match="SEAM_PREFETCH"):
        gemv.parse_tuning("PREFETCH=1")
    with pytest.raises(ValueError, match="KEY=INT"):
        gemv.parse_tuning("R=two")


def test_the_seam_runs_apart_where_launches_may_not_wait_on_each_other(monkeypatch):
    """On Metal (kernels.backends.cross_group_waits) a seam is its two GEMVs as two launches: the
    output projection with its residual, then RMSNorm + the next projection over its output. On
    CUDA, one seam launch. Recorded, not run (CPU)."""
    from kernels import backends
    from kernels.runtime import recording
    from reference.quant import quantize

    def seam_launches(target: str) -> list[str]:
        monkeypatch.setattr(backends.runtime, "target_backend", lambda: target)
        w_a = gemv.repack(mx.array(quantize(np.ones((64, 256), np.float32), "q4_0")), "q4_0", 64, 256)
        w_b = gemv.repack(mx.array(quantize(np.ones((96, 64), np.float32), "q4_0")), "q4_0", 96, 64)
        x = mx.zeros((1, 256), mx.float16)
        with recording() as rec:
            gemv.seam(x, w_a, 64, 256, mx.zeros((1, 64), mx.float16), mx.ones((64,), mx.float16), 1e-6, w_b, 96,
                      "q4_0")
        return [job.spec.name for job in rec.jobs]

    assert seam_launches("cuda") == ["lathe_seam_v3_plain"]
    assert seam_launches("metal") == ["lathe_gemv_v3_residual", "lathe_rmsnorm_gemv_v3"]


@pytest.mark.parametrize("setting, bound", [("row", True), ("launch", False)])
def test_a_v3_seam_takes_gemv_row_passes_as_its_constant(setting, bound, monkeypatch):
    """A v3 seam's two GEMVs share the X' chunk of the longer K; gemv_row_passes sets whether a
    lane's passes stop at its own row's chunks (seam.metal's ROW_PASSES). Recorded, not run."""
    from kernels import backends, options
    from kernels.runtime import recording

    monkeypatch.setattr(backends.runtime, "target_backend", lambda: "cuda")
    w_a, w_b = _zero_packed("q4_0", 256, 1024), _zero_packed("q4_0", 96, 256)
    with options.use(gemv_row_passes=setting), recording() as rec:
        gemv.seam(mx.zeros((1, 1024), mx.float16), w_a, 256, 1024, mx.zeros((1, 256), mx.float16),
                  mx.ones((256,), mx.float16), 1e-6, w_b, 96, "q4_0")
    (job,) = rec.jobs
    assert job.spec.name == "lathe_seam_v3_plain" and job.constants["ROW_PASSES"] is bound


def _zero_packed(qtype: str, n: int, k: int) -> gemv.Packed:
    """Zero weights of [n, k] in `qtype`, repacked (on the CPU: no kernel runs)."""
    from reference import formats

    return gemv.repack(mx.zeros((n, n and formats.row_bytes(qtype.upper(), k)), mx.uint8), qtype, n, k)


@pytest.mark.parametrize("qtype, packed, split", [("q4_0", True, 4), ("q8_0", True, 4), ("q4_0", False, 1),
                                                  ("q8_0", False, 1), ("q6_k", True, 1)])
def test_dequantize_takes_four_threads_a_repacked_block(qtype, packed, split, monkeypatch):
    """DEQUANT_SPLIT 4: a repacked Q4_0/Q8_0 block is four threads' (8 weights each, coalesced
    stores); GGUF blocks and the K-quants stay a thread a block; a split the kernel has no form
    for is refused before any launch. Recorded, not run."""
    from kernels.runtime import recording
    from reference import formats

    n, k = 96, 512
    w = _zero_packed(qtype, n, k) if packed else mx.zeros((n, formats.row_bytes(qtype.upper(), k)), mx.uint8)
    with recording() as rec:
        gemv.dequantize(w, qtype, n, k)
    (job,) = rec.jobs
    assert job.constants["SPLIT"] == split and job.grid[0] == -(-n * k // 32 * split // 256) * 256
    monkeypatch.setitem(gemv.TUNING, "DEQUANT_SPLIT", 2)
    with recording() as rec:
        if split == 4:
            with pytest.raises(ValueError, match="DEQUANT_SPLIT must be 1 or 4"):
                gemv.dequantize(w, qtype, n, k)
        else:  # the knob is not theirs
            gemv.dequantize(w, qtype, n, k)
    assert len(rec.jobs) == (split != 4)


def test_a_pair_is_one_launch_of_both_matrices():
    """gemv_v3's pair (w_b): one launch whose threadgroups past W's take W_B's rows, each matrix
    in its own block type, R and P at the launch's NSIMD, Y [M, N + N_B]. Recorded, not run."""
    from kernels.runtime import recording

    w, w_b = _zero_packed("q4_k", 5120, 4096), _zero_packed("q6_k", 1024, 4096)
    x = mx.zeros((2, 4096), mx.float16)
    with recording() as rec:
        y = gemv.rmsnorm_gemv(x, mx.ones((4096,), mx.float16), 1e-5, w, "q4_k", 5120, 4096, w_b=w_b)
    (job,) = rec.jobs
    assert job.spec.name == "lathe_rmsnorm_gemv_v3_pair" and tuple(y.shape) == (2, 6144)
    assert job.spec.inputs[-2:] == ("w_b", "dims_b")
    c = job.constants
    r, s, p, _ = gemv.v3_geometry("q4_k", 2, 5120, 4096)
    r_b, _, p_b, _ = gemv.v3_geometry("q6_k", 2, 1024, 4096, None, s)
    assert (c["QTYPE"], c["QTYPE_B"], c["R"], c["R_B"], c["P"], c["P_B"], c["NSIMD"]) == (2, 4, r, r_b, p, p_b, s)
    dims, dims_b = (np.array(a).tolist() for a in (job.inputs[2], job.inputs[-1]))
    assert dims[:2] == [5120, 4096] and dims_b[:2] == [1024, 4096]
    assert job.grid[0] == (dims[2] + dims_b[2]) * 32 * s and job.threadgroup[0] == 32 * s
    assert dims[2] == -(-5120 // (r * s)) and dims_b[2] == -(-1024 // (r_b * s))


@pytest.mark.parametrize("qtype, qtype_b, k_b, extra, message", [
    ("q4_k", "q6_k", 512, {}, "K=512"),
    ("q4_k", "q6_k", 256, {"residual": mx.zeros((1, 8), mx.float16)}, "no residual"),
])
def test_a_pair_refuses_what_one_launch_cannot_hold(qtype, qtype_b, k_b, extra, message):
    """A pair whose matrices differ in K, or that would add a residual: a clear
    error before any launch; and v2's GGUF blocks take no pair."""
    from kernels.runtime import recording

    with recording() as rec, pytest.raises(ValueError, match=message):
        gemv.gemv_v3(mx.zeros((1, 256), mx.float16), _zero_packed(qtype, 8, 256), qtype, 8, 256,
                     w_b=_zero_packed(qtype_b, 8, k_b), **extra)
    assert rec.jobs == []
    with pytest.raises(ValueError, match="repacked weights only"):
        gemv.rmsnorm_gemv(x16(), mx.ones((K,), mx.float16), 1e-5, w8(N * 36), "q4_0", N, K, w_b=_zero_packed("q4_0", N, K))


def test_the_qmm_sweep_times_each_knob_that_fits():
    """`lathe bench gemv --sweep`'s qmm rows (no GPU needed to list them): every NB, WN, WK of
    QMM_SWEEP at each shape and row count, but those past the threadgroup memory, which the
    geometry refuses by name, and staged X below K = 4096."""
    from harness.suites.gemv import QMM_SWEEP, QMM_SWEEP_ROWS, QMM_SWEEP_SHAPES, _qmm_sweep, qmm_sweep_label
    from kernels.gemv import block_format, qmm_geometry, qmm_ring_words

    cases = _qmm_sweep()
    assert len({c.label for c in cases}) == len(cases)
    for qtype, n, k in QMM_SWEEP_SHAPES:
        for m in QMM_SWEEP_ROWS:
            fit = []
            for knobs in QMM_SWEEP:
                try:
                    qmm_geometry(m, n, k, knobs["nb"], knobs["wn"], knobs["wk"], xs=knobs.get("xs", 0),
                                 w_ring=qmm_ring_words(block_format(qtype)[0], knobs.get("wr", 0)),
                                 wr=knobs.get("wr", 0))
                    fit.append(qmm_sweep_label(knobs))
                except ValueError as err:
                    assert "threadgroup memory" in str(err)
            if k < 4096:  # Qwen3's shapes: staged X not swept
                fit = [label for label in fit if "-XS" not in label]
            listed = [c.variant for c in cases if (c.shape["M"], c.shape["N"], c.shape["K"]) == (m, n, k)
                      and not c.variant.endswith("-R8")]
            assert listed == fit and len(fit) > len([kn for kn in QMM_SWEEP if not kn.get("xs")]) // 2
    # RowBlocks' rows: each QMM_ROWS8_SWEEP setting that fits, on the 8B's four matrices, each also
    # on Packed weights
    from harness.suites.gemv import QMM_ROWS8_SHAPES, QMM_ROWS8_SWEEP
    rows8 = [c for c in cases if c.variant.endswith("-R8")]
    assert {(c.kernel.removeprefix("gemv_"), c.shape["N"], c.shape["K"]) for c in rows8} == set(QMM_ROWS8_SHAPES)
    assert {c.variant.removesuffix("-R8") for c in rows8} == {qmm_sweep_label(kn) for kn in QMM_ROWS8_SWEEP}
    assert {c.variant.removesuffix("-R8") for c in rows8} <= {c.variant for c in cases}


def test_qmm_mma_rows8_sweep_has_packed_rows_beside(monkeypatch):
    """Each RowBlocks row of qmm_mma's sweep (QMM_MMA_ROWS8_SWEEP, '-R8') has a Packed row of the same
    knobs, shape and rows of X, once, and `qmm_mma_rows8_match` selects exactly those pairs. Listed
    with native kernels taken as available (nothing compiled or run)."""
    from harness.check import matches
    from harness.suites import gemv as suite
    from kernels import native

    monkeypatch.setattr(native, "available", lambda: True)
    cases = suite._qmm_mma_sweep()
    key = lambda c: (c.variant.removesuffix("-R8"), c.kernel, c.shape["M"], c.shape["N"], c.shape["K"])  # noqa: E731
    rows8 = [key(c) for c in cases if c.variant.endswith("-R8")]
    packed = [key(c) for c in cases if not c.variant.endswith("-R8")]
    assert rows8 and len(set(rows8)) == len(rows8) and len(set(packed)) == len(packed)
    assert set(rows8) <= set(packed)
    assert {m for _, _, m, _, _ in rows8} == set(suite.QMM_MMA_ROWS8_ROWS)
    chosen = [key(c) for c in cases if matches(c.label, suite.qmm_mma_rows8_match())]
    assert set(rows8) <= set(chosen) and {v for v, *_ in chosen} == {v for v, *_ in rows8}


def test_every_sweep_case_names_the_gemv_rows_shape():
    """results refuses a gemv row without M, N and K: the whole sweep (v2, v3, qmm, the probe)
    names each, so no run of `lathe bench gemv --sweep` ends at the write."""
    from harness.results import SHAPE_COLUMNS
    from harness.suites.gemv import sweep_cases

    cases = sweep_cases()
    assert any(c.benchmark == "gemv-probe" for c in cases)
    for case in cases:
        assert set(SHAPE_COLUMNS["gemv"]) <= set(case.shape), (case.benchmark, case.variant)


@pytest.mark.parametrize("m, qmm_on, launched", [
    (3, True, ("lathe_gemv_v3",)),  # a decode's rows: the GEMV
    # a short prompt's: the quantized GEMM, K split (K from 4096: qmm_by_shape) and the parts added
    (5, True, ("lathe_qmm_split", "lathe_qmm_reduce")), (64, True, ("lathe_qmm_split", "lathe_qmm_reduce")),
    (65, True, ("lathe_dequantize",)),  # past QMM_UP_TO: dequantize + MLX's matmul
    (20, False, ("lathe_dequantize",)), (9, False, ("lathe_gemv_v3",) * 3)])  # the option off: as before
def test_linear_takes_qmm_for_a_short_prompts_rows(m, qmm_on, launched):
    """linear() on repacked weights: the GEMV up to 4 rows, qmm from 5 to QMM_UP_TO (prompt_qmm),
    the earlier paths past it or with the option off. Recorded, not run."""
    from kernels import options
    from kernels.runtime import recording

    w = _zero_packed("q4_k", 4104, 4096)  # rows not a whole threadgroup's
    x = mx.zeros((m, 4096), mx.float16)
    with options.use(prompt_qmm=qmm_on), recording() as rec:
        y = gemv.linear(x, w, "q4_k", 4104, 4096, residual=mx.zeros((m, 4104), mx.float16))
    assert tuple(y.shape) == (m, 4104)
    assert tuple(j.spec.name.removesuffix("_residual") for j in rec.jobs) == launched
    if launched[0] == "lathe_qmm_split":
        job, reduce = rec.jobs
        shaped = gemv.qmm_by_shape(m, 4104, 4096, "q4_k")
        mp, nb, wn, wk = gemv.qmm_geometry(m, 4104, 4096, shaped["NB"], shaped["WN"], shaped["WK"])
        groups = -(-4104 // (8 * nb * wn))
        assert reduce.spec.name == "lathe_qmm_reduce_residual" and job.constants["MP"] == mp
        assert job.grid[:2] == (groups * 32 * wn * wk, gemv.qmm_parts(groups, m)) and job.constants["KS"] > 1


@pytest.mark.parametrize("m, n, k, staged, want", [
    (16, 4096, 4096, 2, dict(NB=4, WN=4, WK=1, XS=2)), (16, 4096, 4096, 3, dict(NB=4, WN=4, WK=1, XS=3)),
    (64, 4096, 4096, 3, dict(NB=4, WN=4, WK=1, XS=2)),  # 3 buffers of 64 rows past 48 KiB: 2
    (32, 4096, 14336, 4, dict(NB=2, WN=8, WK=1, XS=4)),  # K the longer: 8 SIMD groups across N
    (9, 4096, 1024, 2, dict(NB=4, WN=4, WK=1, XS=2))])  # Qwen3's K: unsplit, as its rule
def test_qmm_x_staged_option_takes_the_staged_knobs(m, n, k, staged, want):
    """Option qmm_x_staged forced on: qmm_by_shape's staged geometry on any shape, launched as such,
    with fewer buffers where they would not fit; then 0 (never staged): the unstaged rule. The
    knobs are passed to the cached geometry, so that turning the option on and off in one process
    launches each. Recorded, not run."""
    from kernels import options
    from kernels.runtime import recording

    w = _zero_packed("q4_0", n, k)
    for setting in (staged, 0):
        with options.use(qmm_x_staged=setting), recording() as rec:
            gemv.qmm(mx.zeros((m, k), mx.float16), w, "q4_0", n, k)
            expected = want if setting else dict(gemv.qmm_by_shape(m, n, k, "q4_0"))
        job = rec.jobs[0]
        assert {key: job.constants[key] for key in ("NB", "WN", "WK", "XS")} == \
            {key: expected[key] for key in ("NB", "WN", "WK", "XS")}
        assert job.spec.threadgroup_bytes(job.constants) <= 48 * 1024
        groups = -(-n // (8 * expected["NB"] * expected["WN"]))
        split = k >= 4096 and gemv.qmm_parts(groups, m, expected["WN"] * expected["WK"]) > 1
        assert ("KS" in job.constants) == split
        if not setting:
            assert expected["XS"] == 0


def test_the_qmm_x_staged_option_refuses_one_buffer():
    """One buffer could not be filled while another is read: refused when the option is parsed."""
    from kernels import options

    with pytest.raises(ValueError, match="2..4 buffers"):
        options.parse("qmm_x_staged=1")


def test_qmm_refuses_what_it_does_not_take():
    """Before any launch: more than QMM_MAX_M rows, GGUF blocks, an unknown knob or one out of its
    range, staged X (or W's ring) past the threadgroup memory, W's ring without X's rounds or with
    pf, a residual of another shape."""
    w = _zero_packed("q8_0", 64, 256)
    x = mx.zeros((8, 256), mx.float16)
    with pytest.raises(ValueError, match="M in 1..64"):
        gemv.qmm(mx.zeros((65, 256), mx.float16), w, "q8_0", 64, 256)
    with pytest.raises(ValueError, match="repacked"):
        gemv.qmm(x, mx.zeros((64, 8 * 34), mx.uint8), "q8_0", 64, 256)
    with pytest.raises(ValueError, match="unknown launch knobs"):
        gemv.qmm(x, w, "q8_0", 64, 256, rows=2)
    with pytest.raises(ValueError, match="ks must be at least 1"):
        gemv.qmm(x, w, "q8_0", 64, 256, ks=0)
    with pytest.raises(ValueError, match="pf .* must be 0 or 1"):
        gemv.qmm(x, w, "q8_0", 64, 256, pf=2)
    with pytest.raises(ValueError, match="xs .* must be 0, 2, 3 or 4"):
        gemv.qmm(x, w, "q8_0", 64, 256, xs=1)
    with pytest.raises(ValueError, match="wst .* must be 0 or 1"):
        gemv.qmm(x, w, "q8_0", 64, 256, wst=2)
    with pytest.raises(ValueError, match="XS=3 does not fit"):  # 3 buffers of 64 rows past 48 KiB
        gemv.qmm(mx.zeros((64, 256), mx.float16), w, "q8_0", 64, 256, xs=3, nb=2, wn=8, wk=1)
    with pytest.raises(ValueError, match="wr .* must be 0 or 1 with xs"):  # on X's rounds: xs - 1 ahead
        gemv.qmm(x, w, "q8_0", 64, 256, xs=2, wr=2)
    with pytest.raises(ValueError, match=r"wr .* must be 0\.\.4, got 5"):  # its own schedule: 1..4 ahead
        gemv.qmm(x, w, "q8_0", 64, 256, wr=5, xs=0)
    with pytest.raises(ValueError, match="wr and pf both fetch W ahead"):  # W ahead twice over
        gemv.qmm(x, w, "q8_0", 64, 256, wr=1, xs=2, pf=1)
    with pytest.raises(ValueError, match="wr and pf both fetch W ahead"):
        gemv.qmm(x, w, "q8_0", 64, 256, wr=2, pf=1)
    with pytest.raises(ValueError, match="WR=4 does not fit"):  # Q8_0's 5 slots of 4 row blocks, 128 threads
        gemv.qmm(mx.zeros((16, 256), mx.float16), w, "q8_0", 64, 256, wr=4, nb=4, wn=2, wk=2)
    with pytest.raises(ValueError, match="XS=3, WR=1 does not fit"):  # Q8_0's ring of 3 slots, 256 threads
        gemv.qmm(mx.zeros((16, 256), mx.float16), w, "q8_0", 64, 256, xs=3, wr=1, nb=4, wn=4, wk=2)
    with pytest.raises(ValueError, match="residual"):
        gemv.qmm(x, w, "q8_0", 64, 256, residual=mx.zeros((8, 63), mx.float16))
    # the RMSNorm prologue and the gated epilogue
    with pytest.raises(ValueError, match=r"gamma must be \[K=256\]"):
        gemv.qmm(x, w, "q8_0", 64, 256, gamma=mx.ones((128,), mx.float16), eps=1e-5)
    with pytest.raises(ValueError, match="eps must be positive"):
        gemv.qmm(x, w, "q8_0", 64, 256, gamma=mx.ones((256,), mx.float16))
    with pytest.raises(ValueError, match="activation must be one of"):
        gemv.qmm(x, w, "q8_0", 64, 256, activation="relu")
    with pytest.raises(ValueError, match="an even N"):
        gemv.qmm(x, _zero_packed("q8_0", 66 - 1, 256), "q8_0", 65, 256, activation="silu")
    with pytest.raises(ValueError, match="no residual"):
        gemv.qmm(x, w, "q8_0", 64, 256, activation="silu", residual=mx.zeros((8, 32), mx.float16))
    with pytest.raises(ValueError, match="nb must be even"):
        gemv.qmm(x, w, "q8_0", 64, 256, activation="silu", nb=1)


@pytest.mark.parametrize("qtype, words", [("q4_0", 1), ("q8_0", 2), ("q4_k", 0)])
def test_qmm_w_ring_takes_threadgroup_memory_for_q4_0_and_q8_0_only(qtype, words):
    """wr 1: XS (here 2) slots of each thread's NB chunks of W (16 bytes a word: Q4_0 1 a chunk, Q8_0 2) and
    their d words, counted in the launch's threadgroup memory; the other block types load W as
    without it (the kernel's W_RING is off for them) and take none. Recorded, not run."""
    from kernels.runtime import recording

    k = 256 if qtype == "q4_k" else 4128
    with recording() as rec:
        gemv.qmm(mx.zeros((16, k), mx.float16), _zero_packed(qtype, 1000, k), qtype, 1000, k,
                 xs=2, wr=1, nb=4, wn=4, wk=1)
    job = rec.jobs[0]
    c = job.constants
    assert c["WR"] == 1 and gemv.qmm_ring_words(c["QTYPE"], c["WR"]) == words
    without = gemv.qmm_smem_bytes(c["MP"], c["NB"], c["WN"], c["WK"], False, c["XS"])
    ring = 2 * 4 * 128 * (16 * words + 4) - (16 + 4) if words else 0  # less the arrays' one element
    assert job.spec.threadgroup_bytes(c) == without + ring <= 48 * 1024


@pytest.mark.parametrize("qtype, words", [("q4_0", 1), ("q8_0", 2), ("q4_k", 0)])
@pytest.mark.parametrize("wr", [1, 2, 4])
def test_qmm_w_ring_on_its_own_schedule_takes_wr_plus_one_slots(qtype, words, wr):
    """wr 1..4 without xs: W's ring on its own schedule, wr super-chunks ahead in wr + 1 slots of each
    thread's NB chunks and their d words; unstaged X (no buffers). The other block types take none.
    Recorded, not run."""
    from kernels.runtime import recording

    k = 256 if qtype == "q4_k" else 4128
    with recording() as rec:
        gemv.qmm(mx.zeros((16, k), mx.float16), _zero_packed(qtype, 1000, k), qtype, 1000, k,
                 wr=wr, nb=2, wn=2, wk=2)
    c = rec.jobs[0].constants
    assert (c["WR"], c["XS"], c["PF"]) == (wr, 0, 0)
    without = gemv.qmm_smem_bytes(c["MP"], c["NB"], c["WN"], c["WK"])
    ring = (wr + 1) * 2 * 128 * (16 * words + 4) - (16 + 4) if words else 0
    assert rec.jobs[0].spec.threadgroup_bytes(c) == without + ring <= 48 * 1024


def test_qmm_gated_launches_gate_and_up_in_one_threadgroup():
    """A gated qmm's grid covers F outputs (not 2F), its output is [M, F], the prologue's rows of
    1 / rms are counted in its threadgroup memory. Recorded, not run."""
    from kernels.runtime import recording

    w = _zero_packed("q4_0", 2 * 1000, 1024)
    with recording() as rec:
        y = gemv.qmm(mx.zeros((9, 1024), mx.float16), w, "q4_0", 2000, 1024, gamma=mx.ones((1024,), mx.float16),
                     eps=1e-5, activation="gelu")
    assert tuple(y.shape) == (9, 1000)
    (job,) = rec.jobs
    assert job.spec.name == "lathe_qmm_norm_gelu"
    c = job.constants
    assert job.grid[0] == -(-1000 // (8 * c["NB"] // 2 * c["WN"])) * 32 * c["WN"] * c["WK"]
    assert gemv.qmm_smem_bytes(c["MP"], c["NB"], c["WN"], c["WK"], norm=True) == \
        gemv.qmm_smem_bytes(c["MP"], c["NB"], c["WN"], c["WK"]) + 4 * c["MP"]


@pytest.mark.parametrize("m, n, k, knobs, ks", [(16, 4096, 4096, dict(ks=4), 4), (9, 1024, 96, {}, 1),
                                                 (64, 4104, 14336, {}, None)])
def test_qmm_next_norm_adds_the_parts_and_norms_each_row_in_one_launch(monkeypatch, m, n, k, knobs, ks):
    """qmm + residual with next_norm: (Y, H), both [M, N] fp16, from qmm's split launch (K in one part
    where unsplit) and one adding launch of a threadgroup a row, no rmsnorm launch: kernels.loop's
    rmsnorm NSIMD up to N = 1024, past it a word a thread up to 32 SIMD groups. Recorded, not run."""
    from kernels import backends, loop
    from kernels.runtime import recording

    with recording() as rec:
        y, h = gemv.qmm(mx.zeros((m, k), mx.float16), _zero_packed("q4_0", n, k), "q4_0", n, k,
                        residual=mx.zeros((m, n), mx.float16), next_norm=(mx.ones((n,), mx.float16), 1e-5), **knobs)
    assert tuple(y.shape) == tuple(h.shape) == (m, n)
    split, add = rec.jobs
    assert split.spec.name.startswith("lathe_qmm_split") and add.spec.name == "lathe_qmm_reduce_residual_norm"
    assert split.constants["KS"] == add.constants["KS"] == (ks or split.constants["KS"])
    nsimd = add.constants["NSIMD"]
    assert nsimd == {1024: loop.NSIMD, 4096: 16, 4104: 17}[n] and gemv.QMM_REDUCE_NSIMD == loop.NSIMD
    assert add.grid == (m * 32 * nsimd, 1, 1) and add.threadgroup == (32 * nsimd, 1, 1)
    assert gemv.qmm_reduce_nsimd(8 * 32 * 40) == 32  # at most 1024 threads on CUDA, 256 on Metal
    monkeypatch.setattr(backends.runtime, "target_backend", lambda: "metal")  # 256 threads a threadgroup
    assert gemv.qmm_reduce_nsimd(4096) == 8 and gemv.qmm_reduce_nsimd(1024) == loop.NSIMD


@pytest.mark.parametrize("combine", ["auto", "last_group", "launch"])
def test_qmm_split_adds_its_parts_in_the_launch_where_its_site_counts(monkeypatch, combine):
    """qmm with K split (Qwen3's down at 8 rows: the rule's 8 parts) and its site's counters: under
    qmm_combine last_group (and auto, at 8 rows) one launch, the counters in, the parts and Y out;
    under launch the split launch and the adding one. Without counters, or with next_norm (whose
    rows need every row block's parts), the adding launch either way. Recorded, not run."""
    from kernels import options
    from kernels.runtime import recording

    monkeypatch.setitem(options._values, "qmm_combine", combine)
    n, k = 1024, 3072
    x, w, r = mx.zeros((8, k), mx.float16), _zero_packed("q8_0", n, k), mx.zeros((8, n), mx.float16)
    counters = gemv.qmm_counters(n)
    with recording() as rec:
        y = gemv.qmm(x, w, "q8_0", n, k, residual=r, counters=counters)
    assert tuple(y.shape) == (8, n)
    if combine != "launch":
        (job,) = rec.jobs
        assert job.spec.name == "lathe_qmm_split_last_residual" and job.constants["KS"] == 8
        assert dict(zip(job.spec.inputs, job.inputs))["counters"] is counters
        assert job.grid[1] == 8 and counters.size >= job.grid[0] // job.threadgroup[0]  # a counter a row block
    else:
        assert [j.spec.name for j in rec.jobs] == ["lathe_qmm_split", "lathe_qmm_reduce_residual"]
    with recording() as rec:
        gemv.qmm(x, w, "q8_0", n, k, residual=r)
        gemv.qmm(x, w, "q8_0", n, k, residual=r, counters=counters, next_norm=(mx.ones((n,), mx.float16), 1e-5))
        gemv.qmm(x, w, "q8_0", n, k, residual=r, counters=counters, ks=1)  # unsplit: one launch, no counters
    assert [j.spec.name for j in rec.jobs] == ["lathe_qmm_split", "lathe_qmm_reduce_residual", "lathe_qmm_split",
                                               "lathe_qmm_reduce_residual_norm", "lathe_qmm_residual"]


def test_qmm_combine_auto_adds_in_the_launch_up_to_16_rows(monkeypatch):
    """qmm_combine auto: the split launch adds its own parts up to QMM_LAST_UP_TO rows, the adding
    launch past them (the 8B's steps of 64 were slower with the in-launch adds); last_group and
    launch hold at every row count."""
    from kernels import options

    for combine, want in (("auto", {8: True, 16: True, 17: False, 64: False}),
                          ("last_group", dict.fromkeys((8, 64), True)), ("launch", dict.fromkeys((8, 64), False))):
        monkeypatch.setitem(options._values, "qmm_combine", combine)
        assert {m: gemv.qmm_last_group(m) for m in want} == want, combine
    assert gemv.QMM_LAST_UP_TO == 16


def test_qmm_refuses_counters_that_do_not_fit_before_any_launch():
    """The site's counters must be uint32 with one for each row block of the launch."""
    from kernels.runtime import recording

    n, k = 1024, 3072
    x, w = mx.zeros((8, k), mx.float16), _zero_packed("q8_0", n, k)
    with recording() as rec:
        for bad in (mx.zeros((n // 8 + 1,), mx.int32), mx.zeros((3,), mx.uint32)):
            with pytest.raises(ValueError, match="counters must be uint32"):
                gemv.qmm(x, w, "q8_0", n, k, counters=bad)
    assert not rec.jobs


def test_qmm_next_norm_needs_a_residual_stream():
    """next_norm normalizes the residual stream: refused without a residual, gated, with N not a
    multiple of 8 (rmsnorm's 8 values a thread), or with gamma not [N], before any launch."""
    from kernels.runtime import recording

    x, w, r = mx.zeros((8, 256), mx.float16), _zero_packed("q8_0", 64, 256), mx.zeros((8, 64), mx.float16)
    norm = (mx.ones((64,), mx.float16), 1e-5)
    with recording() as rec:
        with pytest.raises(ValueError, match="next_norm normalizes the residual stream"):
            gemv.qmm(x, w, "q8_0", 64, 256, next_norm=norm)
        with pytest.raises(ValueError, match="next_norm normalizes the residual stream"):
            gemv.qmm(x, w, "q8_0", 64, 256, activation="silu", next_norm=(mx.ones((32,), mx.float16), 1e-5))
        with pytest.raises(ValueError, match="next_norm normalizes the residual stream"):
            gemv.qmm(x, _zero_packed("q8_0", 60, 256), "q8_0", 60, 256, residual=mx.zeros((8, 60), mx.float16),
                     next_norm=(mx.ones((60,), mx.float16), 1e-5))
        with pytest.raises(ValueError, match=r"gamma must be \[K=64\]"):
            gemv.qmm(x, w, "q8_0", 64, 256, residual=r, next_norm=(mx.ones((256,), mx.float16), 1e-5))
        with pytest.raises(ValueError, match="eps must be positive"):
            gemv.qmm(x, w, "q8_0", 64, 256, residual=r, next_norm=(norm[0], 0.0))
    assert not rec.jobs


def _sg8x8_row(lane: int) -> int:  # lathe.h's
    return ((lane // 4) & 4) + (lane // 2) % 4


def _sg8x8_col(lane: int) -> int:
    return ((lane // 4) & 2) * 2 + (lane % 2) * 2


@pytest.mark.parametrize("m, n, k, ks, nb, wn, gated", [
    (16, 4097, 4128, 4, 2, 2, False), (9, 1000, 1024, 3, 2, 2, False), (64, 4096, 14336, 8, 2, 2, False),
    (20, 2 * 1001, 4128, 3, 2, 2, True), (33, 2 * 515, 2048, 2, 4, 2, True)])
def test_a_split_qmm_covers_k_and_writes_each_partial_sum_once(m, n, k, ks, nb, wn, gated):
    """qmm.metal's LATHE_SPLIT, modelled on the host: the splits' ranges of K (qmm_splits) tile
    0..K in whole super-chunks, and the lanes of the first WK group of every threadgroup write
    each (split, row of X, row of W) of part exactly once; gated, gate's rows and up's rows, so
    that qmm_reduce finds both halves of every output."""
    ks, kspl = gemv.qmm_splits(k, ks)
    ranges = [(s * kspl, min(k, s * kspl + kspl)) for s in range(ks)]
    assert ranges[0][0] == 0 and ranges[-1][1] == k and all(a < b for a, b in ranges)
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:])) and kspl % 128 == 0
    n_out = n // 2 if gated else n
    nbo = nb // 2 if gated else nb
    groups = -(-n_out // (8 * nbo * wn))
    mb_count = -(-m // 16) * 16 // 8
    written = np.zeros((ks, m, n), np.int32)
    for split in range(ks):
        for tg in range(groups):
            for w in range(wn):
                row0 = (tg * wn + w) * nbo * 8
                for lane in range(32):
                    r, c = _sg8x8_row(lane), _sg8x8_col(lane)
                    for j in range(nb):
                        for mb in range(mb_count):
                            row, col = 8 * mb + r, row0 + 8 * (j % nbo) + c
                            at = (0 if j < nbo else n_out) + col
                            for h in (0, 1):
                                if row < m and col + h < n_out:
                                    written[split, row, at + h] += 1
    assert (written == 1).all()


@pytest.mark.parametrize("m, k, wk, nt, ks", [(5, 4128, 1, 256, 1), (16, 4096, 1, 256, 1), (20, 4128, 2, 256, 1),
                                               (64, 4096, 1, 256, 1), (9, 96, 4, 256, 1), (16, 14336, 1, 128, 3)])
def test_staged_x_pieces_are_the_ones_each_lane_would_load(m, k, wk, nt, ks):
    """qmm.metal's XS, modelled on the host: in every round, QMM_STAGE_X's copies put each 16-byte
    piece of X where the lanes of SIMD group (ks) read it back, so that a lane gets the very
    piece it loads unstaged (row m, chunk 4s + c/2, piece q) wherever the row and chunk lie
    inside M and K; each piece of a buffer is written once a round; and on CUDA's lanes the 8
    lanes of a 16-byte phase (2 rows, 4 chunks) meet 8 different bank quads."""
    mp = -(-m // 16) * 16
    row_pieces = 16 * wk + 2
    chunks_k = k // 32
    for split, (k_begin, k_end) in enumerate(
            [(p * kspl, min(k, p * kspl + kspl)) for kspl in [gemv.qmm_splits(k, ks)[1]] for p in range(ks)]):
        rounds = (-(-(k_end - k_begin) // 128) + wk - 1) // wk
        for t in range(rounds):
            staged = {}
            for u in range(mp * 16 * wk):  # the threads' copies, any order
                row, in_row = divmod(u, 16 * wk)
                sc, chunk, q = in_row // 16, (in_row // 4) % 4, in_row % 4
                g = (k_begin // 128 + t * wk + sc) * 4 + chunk
                source = (min(row, m - 1) * k) // 8 + (g * 4 + q if g < chunks_k else q)
                at = row * row_pieces + sc * 16 + chunk * 4 + (q ^ ((chunk >> 1) & 1))
                assert at not in staged and at < mp * row_pieces
                staged[at] = source
            for group in range(wk):
                s = k_begin // 128 + group + t * wk
                for lane in range(32):
                    r, c = lane >> 2, 2 * (lane & 3)  # cuda_compat.h's sg8x8_row / col
                    chunk_of_row = 4 * s + c // 2
                    for row in range(r, mp, 8):
                        live = row < m and chunk_of_row < chunks_k and s * 128 < k_end
                        for q in range(4):
                            at = group * 16 + (c // 2) * 4 + row * row_pieces + (q ^ ((c // 4) & 1))
                            if live:
                                assert staged[at] == (row * k) // 8 + chunk_of_row * 4 + q
            for phase in range(4):  # the bank quads (16 bytes: 4 banks) of one 16-byte load's phases
                for q in range(4):
                    quads = set()
                    for lane in range(8 * phase, 8 * phase + 8):
                        r, c = lane >> 2, 2 * (lane & 3)
                        quads.add((r * row_pieces + (c // 2) * 4 + (q ^ ((c // 4) & 1))) % 8)
                    assert len(quads) == 8


def test_qmm_knobs_given_take_no_staging_from_the_rule():
    """A geometry given (nb, wn or wk) launches unstaged unless xs, pf or wr are given too: the
    rule's staging and W ahead belong to its own geometry (4096 x 4096 past 32 rows would else
    stage X for knobs whose threadgroup memory it does not fit). Recorded, not run."""
    from kernels.runtime import recording

    w = _zero_packed("q4_0", 4096, 4096)
    with recording() as rec:
        gemv.qmm(mx.zeros((33, 4096), mx.float16), w, "q4_0", 4096, 4096, nb=4, wn=2, wk=2)
        gemv.qmm(mx.zeros((33, 4096), mx.float16), w, "q4_0", 4096, 4096, ks=2)
    given, rule = rec.jobs[0], rec.jobs[-2]
    assert (given.constants["XS"], given.constants["PF"], given.constants["WR"]) == (0, 0, 0)
    assert (rule.constants["NB"], rule.constants["XS"], rule.constants["PF"], rule.constants["KS"]) == (4, 2, 1, 2)


@pytest.mark.parametrize("m, n, k, fill, knobs, parts, qtype", [
    (16, 4096, 1024, 512, dict(NB=2, WN=2, WK=4), 1, "q4_0"),  # Qwen3-0.6B's K: 10cb374's knobs, one launch
    (16, 1024, 3072, 512, dict(NB=2, WN=2, WK=4), 8, "q8_0"),  # from K 2048 split: 32 row blocks of 8 groups
    (64, 1024, 2048, 512, dict(NB=2, WN=2, WK=4), 4, "q8_0"),
    (16, 4096, 4096, 512, dict(NB=4, WN=2, WK=2), 8, "q4_0"),  # the 8B's: 64 row blocks, 512 threadgroups
    (64, 4096, 4096, 512, dict(NB=4, WN=2, WK=2), 4, "q6_k"),  # past 32 rows half the threadgroups
    (16, 28672, 4096, 512, dict(NB=4, WN=2, WK=2), 1, "q4_0"),  # enough row blocks already
    (16, 4096, 4096, 0, dict(NB=4, WN=2, WK=2), 1, "q4_0"),  # qmm_fill 0: never split
    (16, 4096, 14336, 512, dict(NB=4, WN=2, WK=2, XS=0), 8, "q4_0"),  # 16 rows: never staged
    (32, 4096, 4096, 512, dict(NB=4, WN=2, WK=2, XS=0), 8, "q4_0"),  # below 4096 x 14336 weights: staged past 32 rows only
    # Q4_0 and Q8_0 past 32 rows, K from 4096: staged X, W a super-chunk ahead (d1c7394's sweep); 8
    # SIMD groups a threadgroup count twice toward qmm_fill; W fetched ahead: at most 4 parts
    (64, 4096, 4096, 512, dict(NB=4, WN=4, WK=1, XS=2, PF=1, WR=0), 4, "q4_0"),
    (64, 28672, 4096, 512, dict(NB=4, WN=4, WK=1, XS=2, PF=1, WR=0), 1, "q4_0"),
    (64, 4096, 14336, 512, dict(NB=2, WN=8, WK=1, XS=2, PF=1, WR=0), 4, "q4_0"),
    (33, 28672, 4096, 512, dict(NB=4, WN=4, WK=1, XS=2, PF=1), 1, "q4_0"),
    # 17 to 32 rows of the largest: staged X, W through the ring, half of qmm_fill (unsplit here)
    (32, 28672, 4096, 512, dict(NB=4, WN=4, WK=1, XS=2, PF=0, WR=1), 1, "q4_0"),
    (17, 4096, 14336, 512, dict(NB=2, WN=8, WK=1, XS=2, PF=0, WR=1), 4, "q4_0"),
    # the K-quants (W not fetched ahead): staged past 32 rows on the largest only, as a5c36c6's rule
    (64, 28672, 4096, 512, dict(NB=4, WN=4, WK=1, XS=2, PF=0, WR=0), 1, "q4_k"),
    (64, 4096, 4096, 512, dict(NB=4, WN=2, WK=2, XS=0), 4, "q4_k"),
    (32, 28672, 4096, 512, dict(NB=4, WN=2, WK=2, XS=0, WR=0), 1, "q6_k"),
    # Q8_0's ring (two words a chunk) past 48 KiB at 32 rows: the unstaged rule
    (32, 28672, 4096, 512, dict(NB=4, WN=2, WK=2, XS=0, WR=0), 1, "q8_0"),
    (64, 28672, 4096, 512, dict(NB=4, WN=4, WK=1, XS=2, PF=1), 1, "q8_0"),
    # a head of short K (Qwen3's 151936 x 1024): staged past 32 rows, W not ahead (not swept)
    (64, 151936, 1024, 512, dict(NB=4, WN=4, WK=1, XS=2, PF=0), 1, "q8_0")])
def test_qmm_knobs_by_shape(m, n, k, fill, knobs, parts, qtype):
    """qmm_by_shape's arms and qmm_fill's split, as launched (option qmm_x_staged at its default,
    auto). Recorded, not run."""
    from kernels import options
    from kernels.runtime import recording

    with options.use(qmm_fill=fill), recording() as rec:
        gemv.qmm(mx.zeros((m, k), mx.float16), _zero_packed(qtype, n, k), qtype, n, k)
    job = rec.jobs[0]
    assert {key: job.constants[key] for key in knobs} == knobs
    assert job.constants.get("KS", 1) == parts and len(rec.jobs) == (2 if parts > 1 else 1)


def test_the_qmm_rule_stages_only_what_the_backend_holds():
    """Metal's 32 KiB does not hold 2 buffers of 64 rows of staged X (36 KiB): the unstaged rule
    there, where CUDA's 48 KiB stages; 48 rows (27 KiB) stage on both; 32 rows with W's ring (38
    KiB) on CUDA only. Recorded, not run."""
    from kernels.runtime import recording

    w = _zero_packed("q4_0", 28672, 4096)
    for target, m, staged in (("cuda", 64, 2), ("metal", 64, 0), ("metal", 33, 2), ("cuda", 32, 2),
                              ("metal", 32, 0)):
        with recording(target=target) as rec:
            gemv.qmm(mx.zeros((m, 4096), mx.float16), w, "q4_0", 28672, 4096)
        job = rec.jobs[0]
        assert job.constants["XS"] == staged and job.spec.threadgroup_bytes(job.constants) <= (
            32 if target == "metal" else 48) * 1024

# ---- w_order_probe: W's loads in a GEMM's order, alone ---------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(order="diagonal"), "order must be one of"),
    (dict(order="qmm", nb=3), "nb 1, 2, 4 or 8"),
    (dict(order="qmm", depth=3), "depth must be"), (dict(order="qmm", nb=8, depth=4), "within 48 KiB"),
    (dict(order="rows", groups=-1), "groups >= 0")])
def test_w_order_probe_refuses_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gemv.w_order_probe(mx.zeros((64 * 32 * 4,), mx.uint32), 64, 32, **kwargs)


def test_w_order_probe_refuses_a_buffer_of_another_shape():
    with pytest.raises(ValueError, match="w must be uint32"):
        gemv.w_order_probe(mx.zeros((64 * 32 * 4,), mx.uint16), 64, 32, order="qmm")
    with pytest.raises(ValueError, match="whole runs of 32 words"):
        gemv.w_order_probe(mx.zeros((64 * 16 * 4,), mx.uint32), 64, 16, order="qmm")


@pytest.mark.parametrize("nb, groups, warps", [(4, 0, 8), (1, 0, 32), (4, 2, 8), (2, 1, 4)])
def test_w_order_probe_launches_its_grid(nb, groups, warps):
    """One block group a SIMD group (groups 0), or GROUPS threadgroups of 4 striding; the output a
    uint32 a lane. Recorded, not run."""
    from kernels.runtime import recording

    with recording() as rec:
        gemv.w_order_probe(mx.zeros((256 * 64 * 4,), mx.uint32), 256, 64, order="interleaved", nb=nb, groups=groups)
    job = rec.jobs[0]
    assert job.grid == (warps * 32, 1, 1) and job.threadgroup == (128, 1, 1)
    assert job.outputs[0][0] == (warps * 32,) and gemv.w_order_probe_warps(256, nb, groups) == warps


@pytest.mark.gpu
@pytest.mark.parametrize("order", sorted(gemv.W_ORDERS))
@pytest.mark.parametrize("nb, depth, groups", [(4, 1, 0), (4, 4, 3), (1, 2, 0), (8, 2, 1)])
def test_w_order_probe_reads_every_word_once(order, nb, depth, groups):
    """Every order reads each word once: the XOR of the lanes' outputs is the XOR of the matrix (a
    word missed or read twice changes it), on fresh random words, a grid striding or not."""
    if not __import__("kernels.runtime", fromlist=["has_gpu"]).has_gpu():
        pytest.skip("no GPU backend")
    rng = np.random.default_rng(7)
    n, chunks_k = 320, 64  # 40 blocks of 8 rows: a last group of fewer than 4 SIMD groups' items
    words = rng.integers(0, 2 ** 32, n * chunks_k * 4, dtype=np.uint64).astype(np.uint32)
    out = np.array(gemv.w_order_probe(mx.array(words), n, chunks_k, order=order, nb=nb, depth=depth, groups=groups))
    assert np.bitwise_xor.reduce(out) == np.bitwise_xor.reduce(words)
    words[rng.integers(0, words.size)] ^= 1  # and the check can fail
    assert np.bitwise_xor.reduce(out) != np.bitwise_xor.reduce(words)


# ---- RowBlocks: W's row blocks interleaved for qmm ---------------------------------------------------------
@pytest.mark.parametrize("qtype, n, k", [("q4_0", 16, 256), ("q8_0", 24, 384)])
def test_interleave_rows_puts_each_chunk_where_qmm_reads_it(qtype, n, k):
    """A NumPy model of RowBlocks' index: chunk c of row r (its quants, then its scale) moves to
    ((r // 8) * K/128 + c // 4) * 32 + (r % 8) * 4 + c % 4; the same bytes, none lost."""
    rng = np.random.default_rng(3)
    qb, chunks = (16 if qtype == "q4_0" else 32), n * (k // 32)
    data = rng.integers(0, 256, chunks * (qb + 2), dtype=np.uint8)
    out = np.array(gemv.interleave_rows(gemv.Packed(mx.array(data), qtype, n, k)).data)
    quants, scales = data[:chunks * qb].reshape(n, k // 32, qb), data[chunks * qb:].reshape(n, k // 32, 2)
    moved_q, moved_s = out[:chunks * qb].reshape(chunks, qb), out[chunks * qb:].reshape(chunks, 2)
    for r in range(n):
        for c in range(k // 32):
            at = ((r // 8) * (k // 128) + c // 4) * 32 + (r % 8) * 4 + c % 4
            assert (moved_q[at] == quants[r, c]).all() and (moved_s[at] == scales[r, c]).all()


def test_interleave_rows_and_qmm_refuse_what_they_do_not_take():
    w = gemv.Packed(mx.zeros((12 * 4 * 18,), mx.uint8), "q4_0", 12, 128)
    with pytest.raises(ValueError, match="whole row blocks of 8"):
        gemv.interleave_rows(w)
    with pytest.raises(ValueError, match="Q4_0 or Q8_0"):
        gemv.interleave_rows(_zero_packed("q4_k", 8, 256))
    rows = gemv.interleave_rows(_zero_packed("q4_0", 8, 256))
    with pytest.raises(ValueError, match="packed weights are q4_0"):
        gemv.qmm(mx.zeros((5, 256), mx.float16), rows, "q4_0", 16, 256)
    with pytest.raises(ValueError, match="w must be uint8 blocks"):  # a GEMV does not take the layout
        gemv.gemv_v3(mx.zeros((1, 256), mx.float16), rows, "q4_0", 8, 256)
    with pytest.raises(ValueError, match="RowBlocks go to qmm only"):  # nor linear() for a GEMV's rows
        gemv.linear(mx.zeros((3, 256), mx.float16), rows, "q4_0", 8, 256)


def test_qmm_launches_row_blocks_as_rows8():
    """RowBlocks launch qmm with ROWS8 1 and the same knobs as Packed. Recorded, not run."""
    from kernels.runtime import recording

    packed = _zero_packed("q4_0", 4096, 4096)
    with recording() as rec:
        gemv.qmm(mx.zeros((16, 4096), mx.float16), packed, "q4_0", 4096, 4096)
        gemv.qmm(mx.zeros((16, 4096), mx.float16), gemv.interleave_rows(packed), "q4_0", 4096, 4096)
    plain, rows8 = rec.jobs[0], rec.jobs[len(rec.jobs) // 2]
    assert plain.constants["ROWS8"] == 0 and rows8.constants["ROWS8"] == 1
    assert {key: v for key, v in plain.constants.items() if key != "ROWS8"} == \
        {key: v for key, v in rows8.constants.items() if key != "ROWS8"}


# ---- qmm on the warp MMA (qmm_mma.cu: a native CUDA kernel, kernels/native.py) ---------------------
def _qmm_mma_instances():
    """Every instantiation the check suite launches: the cases' shapes with the rule's knobs or
    their own, plain, with the residual and gated."""
    from harness.suites import gemv as suite

    for qtype in gemv.QMM_MMA_QTYPES:
        for m, n, k, residual, knobs in suite.QMM_MMA_CASES:
            yield qtype, _mma_constants(m, n, k, qtype, False, residual, knobs)
        for m, n, k, knobs in suite.QMM_MMA_GATED_CASES:
            yield qtype, _mma_constants(m, n, k, qtype, True, False, knobs)
        for m, n, k, residual, knobs in suite.QMM_MMA_ROWS8_CASES:
            yield qtype, _mma_constants(m, n, k, qtype, False, residual, knobs, rows8=True)
        for m, n, k, knobs in suite.QMM_MMA_ROWS8_GATED_CASES:
            yield qtype, _mma_constants(m, n, k, qtype, True, False, knobs, rows8=True)
        for m, n, k, residual, knobs in suite.QMM_MMA_SK_CASES:
            yield qtype, _mma_constants(m, n, k, qtype, False, residual, knobs)
        for m, n, k, knobs in suite.QMM_MMA_SK_GATED_CASES:
            yield qtype, _mma_constants(m, n, k, qtype, True, False, knobs)


def _mma_constants(m, n, k, qtype, gated, residual, knobs, rows8=False):
    geo = gemv.qmm_mma_launch_knobs(m, n, k, qtype, gated, knobs=knobs)
    return gemv.qmm_mma_constants(qtype, m, n, k, geo, gated, residual, rows8)


@pytest.mark.skipif(bool(_nvrtc_missing()), reason=_nvrtc_missing() or "available")
def test_qmm_mma_compiles_for_sm90a():
    """Each instantiation the check suite launches builds (NVRTC, no GPU), under its own symbol,
    with a ring that fits a CTA's shared memory."""
    from kernels import native

    seen = set()
    for qtype, consts in _qmm_mma_instances():
        key = tuple(consts.items())
        if key in seen:
            continue
        seen.add(key)
        cubin = native.cubin(gemv.QMM_MMA, "lathe_qmm_mma", key)
        assert native.entry_name("lathe_qmm_mma", consts).encode() in cubin
        assert gemv.qmm_mma_smem(consts["M"], qtype, consts["TM"], consts["NW"], consts["STAGES"],
                                 consts["SG"], consts["KW"]) <= gemv.QMM_MMA_SMEM
    assert len(seen) >= 40


@pytest.mark.parametrize("m, n, k, qtype, gated, want", [
    # the 8B's gate+up: two tiles a warp, 224 CTAs of 128 rows, two an SM: one part
    (16, 28672, 4096, "q4_0", False, dict(tm=2, nw=4, ks=1, stages=3, sg=2, kw=1, pf=0)),
    # O: 64 CTAs, three an SM: 4 parts of K
    (16, 4096, 4096, "q4_0", False, dict(tm=1, nw=4, ks=4, stages=3, sg=2, kw=1, pf=0)),
    # down (K 14336): two tiles a warp, 32 CTAs, 8 parts
    (16, 4096, 14336, "q4_0", False, dict(tm=2, nw=4, ks=8, stages=3, sg=2, kw=1, pf=0)),
    # 64 rows of X leave room for 2 slots; 8 warps a CTA past 32 rows
    (64, 28672, 4096, "q4_0", False, dict(tm=2, nw=8, ks=1, stages=2, sg=2, kw=1, pf=0)),
    # gated: a gate and an up tile a warp
    (16, 2 * 14336, 4096, "q4_0", True, dict(tm=2, nw=4, ks=1, stages=3, sg=2, kw=1, pf=0)),
    # Qwen3's down: 16 CTAs that would split K in 8 parts take 4 K warps each, one launch
    (16, 1024, 3072, "q8_0", False, dict(tm=1, nw=4, ks=1, stages=3, sg=2, kw=4, pf=0)),
    # ... and its gate+up at 8 rows (gated: a gate and an up tile a warp)
    (8, 2 * 3072, 1024, "q8_0", True, dict(tm=2, nw=4, ks=1, stages=3, sg=2, kw=4, pf=0)),
    # past 16 rows the parts stay
    (32, 4096, 1024, "q8_0", False, dict(tm=1, nw=4, ks=4, stages=3, sg=2, kw=1, pf=0)),
])
def test_qmm_mma_geometry_rule(m, n, k, qtype, gated, want):
    assert gemv.qmm_mma_geometry(m, n, k, qtype, gated) == want
    assert gemv.qmm_mma_smem(m, qtype, want["tm"], want["nw"], want["stages"], want["sg"], want["kw"]) \
        <= gemv.QMM_MMA_SMEM


def test_qmm_mma_geometry_keeps_parts_for_the_norm():
    """next_norm's launches take K in parts (the adding launch writes the norm): no K warps there,
    and two parts at least."""
    assert gemv.qmm_mma_geometry(16, 1024, 3072, "q8_0", False, parts=2) == \
        dict(tm=1, nw=4, kw=1, ks=8, stages=3, sg=2, pf=0)
    assert gemv.qmm_mma_geometry(16, 28672, 4096, "q4_0", False, parts=2)["ks"] == 2


def test_qmm_mma_refuses_what_it_does_not_take():
    """Before any launch: block types other than Q4_0 / Q8_0, K not whole groups of 128, more than
    64 rows, GGUF blocks, knobs out of range or past the shared memory, a gated call's odd N,
    residual or other activation, a residual of another shape."""
    w = _zero_packed("q8_0", 64, 256)
    x = mx.zeros((8, 256), mx.float16)
    with pytest.raises(ValueError, match="q4_k"):
        gemv.qmm_mma(x, _zero_packed("q4_k", 64, 256), "q4_k", 64, 256)
    with pytest.raises(ValueError, match="K=160"):
        gemv.qmm_mma(mx.zeros((8, 160), mx.float16), _zero_packed("q8_0", 64, 160), "q8_0", 64, 160)
    with pytest.raises(ValueError, match="M in 1..64"):
        gemv.qmm_mma(mx.zeros((65, 256), mx.float16), w, "q8_0", 64, 256)
    with pytest.raises(ValueError, match="repacked"):
        gemv.qmm_mma(x, mx.zeros((64, 8 * 34), mx.uint8), "q8_0", 64, 256)
    with pytest.raises(ValueError, match="knobs"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, tm=3)
    with pytest.raises(ValueError, match="unknown launch knobs"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, wk=8)
    with pytest.raises(ValueError, match="knobs"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, stages=5)
    with pytest.raises(ValueError, match="knobs"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, pf=3)
    with pytest.raises(ValueError, match="shared memory"):
        gemv.qmm_mma(mx.zeros((64, 256), mx.float16), w, "q8_0", 64, 256, tm=4, nw=8, stages=4, sg=8)
    with pytest.raises(ValueError, match="an even N"):
        gemv.qmm_mma(x, _zero_packed("q8_0", 65, 256), "q8_0", 65, 256, activation="silu")
    with pytest.raises(ValueError, match="activation 'silu'"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, activation="gelu")
    with pytest.raises(ValueError, match="no residual"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, activation="silu", residual=mx.zeros((8, 32), mx.float16))
    with pytest.raises(ValueError, match="residual"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, residual=mx.zeros((8, 63), mx.float16))
    with pytest.raises(ValueError, match="stream-K"):  # K in parts
        gemv.qmm_mma(x, w, "q8_0", 64, 256, sk=2, ks=2)
    with pytest.raises(ValueError, match="stream-K"):  # more CTAs than (tile, stage) units: 1 tile x 1 stage
        gemv.qmm_mma(x, w, "q8_0", 64, 256, sk=3)
    with pytest.raises(ValueError, match="counters"):
        gemv.qmm_mma(x, w, "q8_0", 64, 256, sk=1, counters=mx.zeros((1,), mx.int32))
    rows = gemv.interleave_rows(_zero_packed("q8_0", 24, 256))  # gate's 12 rows: not whole row blocks
    with pytest.raises(ValueError, match="whole row blocks"):
        gemv.qmm_mma(x, rows, "q8_0", 24, 256, activation="silu")
    with pytest.raises(ValueError, match="packed weights are"):
        gemv.qmm_mma(x, rows, "q8_0", 16, 256)


@pytest.mark.parametrize("qtype, n, k, norm, activation, next_norm, want", [
    ("q4_0", 4096, 4096, False, None, None, True),
    ("q8_0", 2 * 14336, 4096, False, "silu", None, True),
    ("q4_0", 4096, 4096, False, None, (None, 1e-5), True),  # the parts go to the norm's adding launch
    ("q4_0", 4096, 4096, True, None, None, False),  # the RMSNorm prologue is qmm's
    ("q4_0", 4096, 4096, False, "gelu", None, False),
    ("q4_k", 4096, 4096, False, None, None, False),
    ("q8_0", 4096, 4160, False, None, None, False),  # K not whole groups of 128
    ("q8_0", 1 << 16, 256, False, None, (None, 1e-5), False),  # next_norm's two parts need two stages
])
def test_qmm_hands_to_qmm_mma_what_it_takes(qtype, n, k, norm, activation, next_norm, want, monkeypatch):
    from kernels import native

    monkeypatch.setattr(native, "available", lambda: True)
    assert gemv.qmm_on_mma(qtype, n, k, norm, activation, next_norm) is want
    with options.use(qmm_mma=False):
        assert gemv.qmm_on_mma(qtype, n, k, norm, activation, next_norm) is False
    monkeypatch.setattr(native, "available", lambda: False)
    assert gemv.qmm_on_mma(qtype, n, k, norm, activation, next_norm) is False


def test_qmm_mma_auto_takes_the_large_matrices(monkeypatch):
    """auto: the 8B's matrices (from 4096 x 4096), not Qwen3-0.6B's; on: those too."""
    from kernels import native

    monkeypatch.setattr(native, "available", lambda: True)
    assert gemv.qmm_on_mma("q4_0", 4096, 4096, False, None, None)
    assert not gemv.qmm_on_mma("q8_0", 1024, 3072, False, None, None)
    with options.use(qmm_mma=True):
        assert gemv.qmm_on_mma("q8_0", 1024, 3072, False, None, None)


@pytest.mark.skipif(bool(_nvrtc_missing()), reason=_nvrtc_missing() or "available")
def test_qmm_with_next_norm_on_qmm_mma_adds_parts_in_the_norm_launch(monkeypatch):
    """With the option on (and native kernels taken as available), a decode plan's qmm + residual +
    next_norm is qmm_mma's parts (two at least), then qmm's adding launch that writes the norm;
    with it off, qmm's own split launch. Recorded, not run (the native launch is compiled)."""
    from kernels import native
    from kernels.runtime import recording

    monkeypatch.setattr(native, "available", lambda: True)
    n, k, m = 4096, 4096, 16
    w, x = _zero_packed("q4_0", n, k), mx.zeros((m, k), mx.float16)
    args = dict(residual=mx.zeros((m, n), mx.float16), next_norm=(mx.ones((n,), mx.float16), 1e-5))
    with recording() as rec:
        y, h = gemv.qmm(x, w, "q4_0", n, k, **args)
    (job,) = rec.jobs
    assert job.spec.name == "lathe_qmm_reduce_residual_norm" and job.constants["KS"] >= 2
    assert tuple(y.shape) == tuple(h.shape) == (m, n)
    with options.use(qmm_mma=False), recording() as rec:
        gemv.qmm(x, w, "q4_0", n, k, **args)
    assert [j.spec.name for j in rec.jobs][-1] == "lathe_qmm_reduce_residual_norm" and len(rec.jobs) == 2
