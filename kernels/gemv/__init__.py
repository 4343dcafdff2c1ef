"""Quantized matrix-vector products on GGUF blocks (Q4_0, Q8_0; v3 also Q4_K, Q5_K, Q6_K and the
legacy affine blocks Q4_1, Q5_0, Q5_1):
Y[M, N] = X[M, K] @ W^T.

W is the [N, K / 32 * block bytes] uint8 matrix of reference.quant (GGUF's own bytes: a GGUF
tensor of ne = (K, N) read row after row); X and Y are fp16, arithmetic is fp32.

- `gemv_v1`: the plain design, one SIMD group per output row (M 1..4).
- `gemv_v2`: R rows per SIMD group, X staged once per threadgroup in threadgroup memory (as
  int16 with a scale per block), weights in coalesced 16-byte loads with the next tile in
  flight, exact integer dot products inside a block (gemv_v2.metal; M 1..4).
- `gemv_v3`: on weights repacked once when the model loads (`repack` -> `Packed`: quants apart
  from scales, every 16 bytes of quants aligned), each lane loading its chunks straight into
  registers, several in flight, X' staged as v2 stages it (gemv_v3.metal; M 1..4). `gemv` picks
  v2 or v3 by the weights' type. The K-quants run here only, the block format a compile-time
  QTYPE of the same body: their super-blocks repacked into chunks of 32 weights (low nibbles in
  Q4_0's order, high bits and scales apart: reference/kquant.py's layout).
- `rmsnorm_gemv`, `silu_down_gemv`: v2 (v3 on Packed weights) with RMSNorm(X) * gamma, or
  silu(gate) * up, computed while X is staged (no normalized or activated copy in device memory).
- `rmsnorm_gemv_argmax`: the output head for greedy decoding, v3's RMSNorm+GEMV that also gives
  each row's argmax (the next token), with no argmax launch after it.
- `w_b=` (gemv_v3, rmsnorm_gemv): a pair, a second repacked matrix of a block type of its own
  whose products follow W's in Y, in the same launch (a fused projection whose parts differ in
  type: Q4_K_M's Q6_K attn_v beside Q4_K attn_q and attn_k).
- `gate_up_swiglu`: v3's gate+up (RMSNorm or not) with silu(gate) * up in its epilogue instead:
  the down projection after it is a plain GEMV (the `swiglu_at` option picks which form the loop runs).
- `seam`: a layer's output projection (+ residual) and the next block's RMSNorm+GEMV in one
  launch, the second waiting in the kernel for the first (gemv/seam.metal).
- `quantize`, `dequantize`: the GGUF blocks made and read on the GPU.
- `qmm`: the quantized GEMM for up to 64 rows of X (a short prompt's), on repacked weights of any
  v3 block type: W read once for all rows, decoded in registers into SIMD-group matrices.
- `linear`: any M; the GEMV up to 4 rows, qmm up to `QMM_UP_TO` (64) on repacked weights, GEMV
  launches of up to 4 rows, and from `BATCHED_FROM` rows W dequantized to fp16 once and MLX's matmul.
- Fused projections (QKV, gate+up): `concat_rows` makes one matrix, `linear` runs it, `split`
  cuts the output.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from kernels import backends, options
from kernels.runtime import KernelSpec, Launch, constant, launch, resident

QTYPES = {"q4_0": (0, 18), "q8_0": (1, 34)}
# The K-quants (reference/kquant.py): (QTYPE code, bytes a super-block of 256). The v3 GEMVs
# (repacked weights) and `dequantize` read them; v1 and v2 take Q4_0 and Q8_0 only.
K_QTYPES = {"q4_k": (2, 144), "q5_k": (3, 176), "q6_k": (4, 210)}
# The legacy affine blocks of 32 (reference/quant.py): (QTYPE code, bytes a block). Repacked as
# the K-quants are (their chunks of 32 are the blocks: low nibbles, fifth bits, then each block's
# d, or d and m), they run in v3 only, on the K-quants' code path: value d * q - offset, the
# offset 16 d (Q5_0) or -m (Q4_1, Q5_1). Code 5 is the embedding's F16 (kernels.loop).
LEGACY_QTYPES = {"q4_1": (6, 20), "q5_0": (7, 22), "q5_1": (8, 24)}
# The importance-matrix 4-bit blocks (reference/iquant.py): (QTYPE code, weights a block, bytes a
# block). Their nibbles index a table of 16 int8 levels; repacked as the K-quants (a chunk of 32
# weights' nibbles, then IQ4_NL's d a chunk, or IQ4_XS's 8-byte super-block head as GGUF has it),
# v3 only, each nibble looked up into an int8 byte for the same integer dot products.
IQ4_QTYPES = {"iq4_nl": (9, 32, 18), "iq4_xs": (10, 256, 136)}
V3_QTYPES = (*QTYPES, *K_QTYPES, *LEGACY_QTYPES, *IQ4_QTYPES)
REPACKED_ONLY = (*K_QTYPES, *LEGACY_QTYPES, *IQ4_QTYPES)  # no v1/v2 form: the v3 GEMVs on Packed weights
MAX_M = 4  # rows of X a GEMV launch takes; linear() goes past it
ROWS_PER_THREADGROUP = 4  # v1: SIMD groups (rows) per threadgroup

# v2 launch knobs: rows per SIMD group (R) and SIMD groups per threadgroup (NSIMD), per format,
# from `lathe bench gemv --sweep` on the device (kernels/gemv/NOTES.md has the numbers). Where a
# matrix has too few rows to give MIN_GROUPS threadgroups, NSIMD and then R are halved.
# SLOTS: 0 stages the next weight tile in registers; n >= 2 copies tiles straight into n
# threadgroup slots a SIMD group (cp.async on CUDA), all n issued before the prologue and n - 1
# in flight after (K % 256 == 0, and all of K in one chunk of X beside them: see v2_geometry).
# MAX_GROUPS (0: no limit): threadgroups a launch takes at most, each SIMD group then streaming
# several row groups (only where one chunk of X holds all of K; see gemv_v2.metal). 396 is one
# wave on the H100/H200: 132 SMs, 3 threadgroups of 256 threads at 80 registers each (chosen in
# the decode loop and the projection chain, kernels/gemv/NOTES.md).
# SEAM_SLOTS, SEAM_GROUPS: the seam's (two GEMVs in one launch, gemv/seam.metal) own. Its loop
# over claimed work costs registers: NVRTC's sm_90 cubin gives the seam 93-96 a thread with the
# next tile in registers (2 threadgroups of 256 an SM, so at most SEAM_GROUPS = 264 launched: one
# wave) and 76 with SLOTS 2 (3 an SM, MAX_GROUPS), where the plain GEMVs take 77-90 (0c9c12a).
# So a seam takes SEAM_SLOTS where both of its GEMVs hold all of K in one chunk of X beside the
# slots. SEAM_PREFETCH 1: GEMV B's first weights are issued before the wait for A (0: after it),
# where the seam keeps tiles in registers (SLOTS 0): with slots, issuing B's copies before the
# wait took 88 registers instead of 76 (2 threadgroups an SM, not 3).
# V3_R, V3_NSIMD, V3_P, V3_MAX_GROUPS: the v3 GEMV's (gemv_v3.metal) rows per SIMD group, SIMD
# groups per threadgroup, 16-byte loads in flight per lane and row, and its grid cap; 0 (the
# default): by shape (v3_by_shape), any other value: that value for every shape.
# SEAM_V3_WARPS: a v3 seam's GEMV B takes at most this many SIMD groups (threadgroups of the seam's
# NSIMD), each streaming row groups; 2112 = 16 on each of the 132 SMs, gate+up's best alone (528
# threadgroups of 4). The seam runs B with A's NSIMD: B's own cap (528 of them) at A's 8 SIMD
# groups was two waves, and its seams ran 2-6 us longer than its GEMVs apart. 0: B's
# cap by shape.
# V3_K_SHAPES: 1 gives the K-quants v3 knobs of their own on some shapes (v3_by_shape), 0 Q4_0's
# there too.
# DEQUANT_SPLIT: threads a repacked Q4_0/Q8_0 block in dequantize (4: 8 weights each, coalesced
# stores; 1: the whole block, as GGUF blocks and the K-quants are).
# BLOCK_NSIMD: SIMD groups a threadgroup of a decoder block (kernels.blocks, one threadgroup size
# for all of a launch's phases) with block_geometry=per_gemv; 0: by the launch's GEMVs
# (kernels.blocks.block_geometry).
# BLOCK_P: the most 16-byte loads a lane issues per row before using any (v3's P) in a decoder
# block's GEMV phases; 0: each GEMV's own. A block launch takes its hungriest phase's registers
# for all of them (kernels/loop/NOTES.md).
TUNING = {**{q: {"R": 2, "NSIMD": 8, "SLOTS": 0, "V3_R": 0, "V3_NSIMD": 0, "V3_P": 0} for q in V3_QTYPES},
          "MIN_GROUPS": 256, "MAX_GROUPS": 396, "SEAM_SLOTS": 2, "SEAM_GROUPS": 264,
          "SEAM_PREFETCH": 1, "V3_MAX_GROUPS": 0, "SEAM_V3_WARPS": 2112, "BLOCK_NSIMD": 0, "BLOCK_P": 0,
          "V3_K_SHAPES": 1, "DEQUANT_SPLIT": 4}
_TUNING_DEFAULTS = copy.deepcopy(TUNING)
SMEM_BUDGET = backends.THREADGROUP_MEMORY["cuda"]  # CUDA's; launches size against the target's


def _per_budget(fn):
    """fn cached, its keyword `budget` the threadgroup memory of the backend that launches are
    made for (kernels.backends.threadgroup_memory: 32 KiB on Metal, 48 KiB on CUDA), so that
    one process may make launches for both (lathe compile --metal records Metal's); a caller
    that shares the launch's memory with other arrays gives a smaller one (kernels.blocks)."""
    cached = functools.lru_cache(maxsize=1024)(fn)

    @functools.wraps(fn)
    def call(*args, **kw):
        kw.setdefault("budget", backends.threadgroup_memory())
        return cached(*args, **kw)

    call.cache_clear = cached.cache_clear
    return call
BATCHED_FROM = 16  # linear(): M at which dequantize + MLX matmul overtakes GEMV launches

PROLOGUES = {"plain": 0, "rmsnorm": 1, "swiglu": 2}
_V1 = KernelSpec(name="lathe_gemv_v1", body="gemv/gemv.metal",
                 inputs=("x", "w", "w_half", "dims"), outputs=("y",))
_V2_EXTRA = {"plain": (), "rmsnorm": ("gamma", "eps"), "swiglu": ()}


ACTIVATIONS = {"silu": 0, "gelu": 1}  # the gate's activation (lathe.h's gate_act; harness.program.arch.ACTIVATIONS)


@functools.cache
def _gemv_spec(version: str, prologue: str, residual: bool, swiglu_out: bool = False, pair: bool = False,
               activation: str = "silu", wide_x: bool = False, argmax: bool = False) -> KernelSpec:
    """One v2 or v3 instantiation family: its prologue (what X' is), whether Y adds a residual,
    and (v3) whether Y is act(gate) * up of a [gate; up] matrix's two products, or (pair) the
    products of two matrices of their own block types, side by side. `activation`: the gate's
    (SiLU, or GELU) where the prologue or the epilogue applies one; `wide_x` (v3's RMSNorm
    prologue): X is float32, a residual stream past fp16's range (Gemma's); `argmax` (v3): each
    row's argmax too (gemv_v3.metal's LATHE_ARGMAX), over a scratch input."""
    name = {"plain": "lathe_gemv", "rmsnorm": "lathe_rmsnorm_gemv",
            "swiglu": "lathe_silu_down_gemv"}[prologue] + ("_swiglu_out" if swiglu_out else "") + f"_{version}"
    name += ("_residual" if residual else "") + ("_pair" if pair else "")
    name += ("_gelu" if activation == "gelu" else "") + ("_x32" if wide_x else "") + ("_argmax" if argmax else "")
    return KernelSpec(name, f"gemv/gemv_{version}.metal",
                      ("x", "w", "dims", *_V2_EXTRA[prologue], *(("residual",) if residual else ()),
                       *(("w_b", "dims_b") if pair else ()), *(("argmax_scratch",) if argmax else ())),
                      ("y", *(("token",) if argmax else ())),
                      prelude=f"#define LATHE_PROLOGUE {PROLOGUES[prologue]}\n"
                              f"#define LATHE_RESIDUAL {int(residual)}\n"
                              f"#define LATHE_EPILOGUE {int(swiglu_out)}\n"
                              f"#define LATHE_ACT {ACTIVATIONS[activation]}\n"
                              f"#define LATHE_X32 {int(wide_x)}"
                              + (f"\n#define LATHE_PAIR {int(pair)}" if version == "v3" else "")
                              + ("\n#define LATHE_ARGMAX 1" if argmax else ""),
                      threadgroup_bytes=(_v2_threadgroup_bytes if version == "v2" else
                                         _v3_argmax_threadgroup_bytes if argmax else _v3_threadgroup_bytes),
                      in_place=("argmax_scratch",) if argmax else ())


def _v2_threadgroup_bytes(c: dict) -> int:
    """gemv_v2.metal's arrays (v2_smem_bytes) from a launch's constants."""
    qtype = next(q for q, (code, _) in QTYPES.items() if code == c["QTYPE"])
    return v2_smem_bytes(qtype, c["M"], c["R"], c["NSIMD"], c["XCHUNK"], c["SLOTS"])


def _v3_threadgroup_bytes(c: dict) -> int:
    """gemv_v3.metal's arrays (v3_smem_bytes) from a launch's constants."""
    return v3_smem_bytes(c["M"], c["XCHUNK"], c["NSIMD"])


def _v3_argmax_threadgroup_bytes(c: dict) -> int:
    """... and LATHE_ARGMAX's: a SIMD group's best value and index, the last-threadgroup flag."""
    return _v3_threadgroup_bytes(c) + 8 * c["NSIMD"] + 4


_QUANTIZE = KernelSpec("lathe_quantize", "gemv/quantize.metal", ("w", "dims"), ("q",))
_DEQUANTIZE = KernelSpec("lathe_dequantize", "gemv/dequantize.metal", ("q", "dims"), ("w",))


def _dims(n: int, k: int, *more: int) -> mx.array:
    return constant((n, k, *more))


def _eps(eps: float) -> mx.array:
    return constant((eps,), mx.float32)


def block_format(qtype: str) -> tuple[int, int, int]:
    """(QTYPE code, weights a block, bytes a block) of a GEMV format or a K-quant."""
    if qtype in QTYPES:
        return QTYPES[qtype][0], 32, QTYPES[qtype][1]
    if qtype in LEGACY_QTYPES:
        return LEGACY_QTYPES[qtype][0], 32, LEGACY_QTYPES[qtype][1]
    if qtype in IQ4_QTYPES:
        return IQ4_QTYPES[qtype]
    return K_QTYPES[qtype][0], 256, K_QTYPES[qtype][1]


def _check_qtype_shape(qtype: str, n: int, k: int, formats: tuple[str, ...] = tuple(QTYPES)) -> None:
    if qtype not in formats:
        raise ValueError(f"qtype must be one of {formats}, got {qtype!r}")
    _, per_block, _ = block_format(qtype)
    if k <= 0 or k % per_block:
        raise ValueError(f"K must be a positive multiple of {per_block} ({qtype}'s block), got {k}")
    if n <= 0:
        raise ValueError(f"N must be positive, got {n}")


def _check_weights(w, qtype: str, n: int, k: int) -> None:
    _, per_block, block_bytes = block_format(qtype)
    row_bytes = k // per_block * block_bytes
    if isinstance(w, Packed):
        _check_packed(w, qtype, n, k)
        w = w.data
    if not isinstance(w, mx.array) or w.dtype != mx.uint8:
        raise ValueError(f"w must be uint8 blocks, got {getattr(w, 'dtype', type(w))}")
    if w.size != n * row_bytes:
        raise ValueError(f"w has {w.size} bytes; {qtype} [N={n}, K={k}] takes {n * row_bytes} "
                         f"(N * K/{per_block} blocks of {block_bytes} bytes)")
    if n * row_bytes > 2**31 - 1:
        raise ValueError("the kernels index with 32-bit integers: the matrix is too large")


def _check_fp16(name: str, a: mx.array) -> None:
    if not isinstance(a, mx.array) or a.dtype != mx.float16:
        raise ValueError(f"{name} must be float16, got {getattr(a, 'dtype', type(a))}")


def _check_residual(residual: mx.array, m: int, n: int) -> None:
    _check_fp16("residual", residual)
    if tuple(residual.shape) != (m, n):
        raise ValueError(f"residual must be [M={m}, N={n}], got {tuple(residual.shape)}")


def _check_next_norm(next_norm: tuple[mx.array, float], residual: mx.array | None, activation: str | None,
                     n: int) -> None:
    """qmm's and qmm_mma's next_norm: the norm of the residual stream, so a residual, no activation,
    N a multiple of 8, and gamma [N]."""
    if residual is None or activation is not None or n % 8:
        raise ValueError(f"next_norm normalizes the residual stream: it takes a residual, no activation and N a "
                         f"multiple of 8, got residual {residual is not None}, activation {activation!r}, N={n}")
    _check_norm(next_norm[0], float(next_norm[1]), n)


def _check_norm(gamma: mx.array, eps: float, k: int) -> None:
    """The RMSNorm prologue's weights (fp16 [K]) and eps (> 0)."""
    _check_fp16("gamma", gamma)
    if gamma.shape != (k,):
        raise ValueError(f"gamma must be [K={k}], got {tuple(gamma.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")


def check_gemv_args(x: mx.array, w: mx.array, qtype: str, n: int, k: int,
                    x_width: int | None = None, max_m: int | None = MAX_M, wide_x: bool = False) -> None:
    """Every argument check of the GEMV kernels (before any launch). `x_width` is X's row length
    where it is not K (2K for the gate+up input of silu_down_gemv); `max_m=None` takes any M.
    The K-quants and the legacy affine blocks only as repacked weights (Packed: the v3 GEMVs).
    X is fp16; float32 where `wide_x` (the RMSNorm prologue of a float32 residual stream)."""
    if qtype in REPACKED_ONLY and not isinstance(w, Packed):
        raise ValueError(f"{qtype} runs on repacked weights only (kernels.gemv.repack, the v3 GEMVs); "
                         f"GGUF blocks go to v1/v2, which take {tuple(QTYPES)}")
    _check_qtype_shape(qtype, n, k, V3_QTYPES if isinstance(w, Packed) else tuple(QTYPES))
    if not (wide_x and isinstance(x, mx.array) and x.dtype == mx.float32):
        _check_fp16("activations", x)
    width = k if x_width is None else x_width
    if x.ndim != 2 or x.shape[1] != width or x.shape[0] < 1 or (max_m and x.shape[0] > max_m):
        limit = f"M in 1..{max_m}" if max_m else "M >= 1"
        raise ValueError(f"x must be [M, {width}] with {limit} (K={k}), got {tuple(x.shape)}")
    if x.size > 2**31 - 1:
        raise ValueError("the kernels index with 32-bit integers: x is too large")
    _check_weights(w, qtype, n, k)


# ---- v1 -----------------------------------------------------------------------------------------
def gemv_v1(x: mx.array, w: mx.array, qtype: str, n: int, k: int) -> mx.array:
    """Y[M, N] = X[M, K] @ W^T, W in `qtype` blocks; v1: one SIMD group per output row."""
    check_gemv_args(x, w, qtype, n, k)
    w = w.reshape(-1)
    code, _ = QTYPES[qtype]
    m = x.shape[0]
    groups = -(-n // ROWS_PER_THREADGROUP)
    (y,) = launch(Launch(_V1, [x, w, w.view(mx.float16), _dims(n, k)], [((m, n), mx.float16)],
                         (groups * 32 * ROWS_PER_THREADGROUP, 1, 1),
                         (32 * ROWS_PER_THREADGROUP, 1, 1),
                         dict(QTYPE=code, M=m, NSIMD=ROWS_PER_THREADGROUP)))
    return y


# ---- v2 -----------------------------------------------------------------------------------------
def v2_slots(qtype: str, k: int, slots: int | None = None) -> int:
    """SLOTS of a launch: the tuned (or given) value where rows start 16-byte aligned, else 0.
    (v2_geometry also drops the tuned value where the slots would split X into chunks.)"""
    slots = TUNING[qtype]["SLOTS"] if slots is None else slots
    return slots if (k // 32) % 8 == 0 else 0


def v2_smem_bytes(qtype: str, m: int, rows: int, simds: int, xchunk: int, slots: int = 0) -> int:
    """Threadgroup memory of a v2 launch (gemv_v2.metal's arrays)."""
    weights = simds * rows * 64 * QTYPES[qtype][1] * max(1, slots)
    x = m * (xchunk // 64 * 68 * 2 + xchunk // 32 * 8)  # int16 values, scale and sum per block
    return weights + x + 4 * (m + simds)


def _fill_groups(n: int, r: int, s: int, rows: int | None, simds: int | None) -> tuple[int, int]:
    """R and NSIMD halved (NSIMD first; neither where the caller gave it) until N rows give
    MIN_GROUPS threadgroups, or neither can be halved: small matrices still fill the GPU."""
    while -(-n // (r * s)) < TUNING["MIN_GROUPS"]:
        if s > 1 and not simds:
            s //= 2
        elif r > 1 and not rows:
            r //= 2
        else:
            break
    return r, s


@_per_budget  # pure; called for every launch of the decode loop
def v2_geometry(qtype: str, m: int, n: int, k: int, rows: int | None = None,
                simds: int | None = None, slots: int | None = None, *, budget: int) -> tuple[int, int, int, int]:
    """(R, NSIMD, XCHUNK, SLOTS) for a launch: the tuned R and NSIMD (or the given ones), halved
    to give small matrices MIN_GROUPS threadgroups unless given; the tuned SLOTS (or the given)
    where rows are aligned, the tuned value only where all of K still fits one chunk of X beside
    the slots (a chunked X costs more than the slots gain: down's K = 14336 keeps SLOTS 0); and
    the largest chunk of X (a multiple of 2048 values, at most K rounded up) that fits in
    threadgroup memory beside them."""
    r, s = _fill_groups(n, rows or TUNING[qtype]["R"], simds or TUNING[qtype]["NSIMD"], rows, simds)
    # The largest chunk of X that fits beside the SIMD groups' weight tiles (measured: keeping
    # NSIMD and splitting K beats fewer SIMD groups with all of K, e.g. 4096 x 14336).
    xchunk = -(-k // 2048) * 2048
    tuned = slots is None
    slots = v2_slots(qtype, k, slots)
    if tuned and slots and v2_smem_bytes(qtype, m, r, s, xchunk, slots) > budget:
        slots = 0
    while xchunk > 2048 and v2_smem_bytes(qtype, m, r, s, xchunk, slots) > budget:
        xchunk -= 2048
    while v2_smem_bytes(qtype, m, r, s, xchunk, slots) > budget:
        if s > 1 and not simds:
            s //= 2
        elif r > 1 and not rows:
            r //= 2
        else:
            raise ValueError(f"R={r}, NSIMD={s} needs {v2_smem_bytes(qtype, m, r, s, 2048, slots)} bytes "
                             f"of threadgroup memory (at most {budget})")
    return r, s, xchunk, slots


SHARED_KNOBS = ("MIN_GROUPS", "MAX_GROUPS", "SEAM_SLOTS", "SEAM_GROUPS", "SEAM_PREFETCH", "V3_MAX_GROUPS",
                "SEAM_V3_WARPS", "BLOCK_NSIMD", "BLOCK_P", "V3_K_SHAPES", "DEQUANT_SPLIT")


def parse_tuning(text: str) -> dict[str, int]:
    """'KEY=INT,...' (or joined by '+', as the gemv_tuning option writes it) -> {KEY: INT}, KEY
    one of TUNING's: per-format R, NSIMD, SLOTS, V3_R, V3_NSIMD, V3_P (set for both formats) or the shared ones
    (SHARED_KNOBS). A clear error for anything else."""
    setting = {}
    for item in filter(None, re.split(r"[,+]", text)):
        key, _, value = item.strip().partition("=")
        if key not in {*TUNING["q4_0"], *SHARED_KNOBS} or not value.isdigit():
            raise ValueError(f"bad GEMV tuning {item!r}: KEY=INT, KEY one of {', '.join(TUNING['q4_0'])}, "
                             f"{', '.join(SHARED_KNOBS)}")
        setting[key] = int(value)
    return setting


def set_tuning(text: str, from_defaults: bool = False) -> dict[str, int]:
    """Set TUNING from 'KEY=INT,...' (parse_tuning): experiments without editing the table (the
    gemv_tuning option sets it from the defaults, kernels.options). Returns the values set."""
    setting = parse_tuning(text)
    if from_defaults:
        TUNING.update(copy.deepcopy(_TUNING_DEFAULTS))
    for key, value in setting.items():
        for table in (TUNING[q] for q in V3_QTYPES) if key in TUNING["q4_0"] else (TUNING,):
            table[key] = value
    v2_geometry.cache_clear()
    seam_geometry.cache_clear()
    v3_geometry.cache_clear()
    return setting


def v2_groups(n: int, k: int, r: int, s: int, xchunk: int, max_groups: int | None = None) -> int:
    """Threadgroups of a v2 launch: one per NSIMD * R rows, at most `max_groups` (or the tuned
    MAX_GROUPS; 0 none) where one chunk of X holds all of K."""
    groups = -(-n // (r * s))
    cap = TUNING["MAX_GROUPS"] if max_groups is None else max_groups
    if cap < 0:
        raise ValueError(f"max_groups must be >= 0, got {cap}")
    return min(groups, cap) if cap and k <= xchunk else groups


def _v2(prologue: str, inputs: list[mx.array], x: mx.array, w: mx.array, qtype: str, n: int,
        k: int, knobs: dict, residual: mx.array | None = None, activation: str = "silu") -> mx.array:
    if isinstance(w, Packed):
        raise ValueError("v2 takes GGUF blocks; repacked (Packed) weights go to the v3 GEMVs")
    w = w.reshape(-1)
    m = x.shape[0]
    if residual is not None:
        _check_residual(residual, m, n)
        inputs = [*inputs, residual]
    rows, simds, slots = knobs.get("rows"), knobs.get("simds"), knobs.get("slots")
    r, s, xchunk, slots = v2_geometry(qtype, m, n, k, rows, simds, slots)
    groups = v2_groups(n, k, r, s, xchunk, knobs.get("max_groups"))
    consts = dict(QTYPE=QTYPES[qtype][0], M=m, R=r, NSIMD=s, ALIGNED=(k // 32) % 8 == 0,
                  XCHUNK=xchunk, SLOTS=slots)
    (y,) = launch(Launch(_gemv_spec("v2", prologue, residual is not None, activation=activation),
                         [x, w, _dims(n, k, groups), *inputs],
                         [((m, n), mx.float16)],
                         (groups * 32 * s, 1, 1), (32 * s, 1, 1), consts))
    return y


def gemv_v2(x: mx.array, w: mx.array, qtype: str, n: int, k: int, *,
            residual: mx.array | None = None, **knobs: int | None) -> mx.array:
    """Y[M, N] = X[M, K] @ W^T (+ residual[M, N]), W in `qtype` blocks, M 1..4. Launch knobs
    (TUNING's when not given): rows (R), simds (NSIMD), slots (SLOTS), max_groups (MAX_GROUPS)."""
    check_gemv_args(x, w, qtype, n, k)
    return _v2("plain", [], x, w, qtype, n, k, _knobs(knobs), residual)


def _knobs(knobs: dict) -> dict:
    unknown = set(knobs) - {"rows", "simds", "slots", "max_groups"}
    if unknown:
        raise ValueError(f"unknown launch knobs {sorted(unknown)}: rows, simds, slots, max_groups")
    return knobs


def rmsnorm_gemv(x: mx.array, gamma: mx.array, eps: float, w: mx.array, qtype: str, n: int,
                 k: int, *, w_b: Packed | None = None, **knobs: int | None) -> mx.array:
    """(RMSNorm(X) * gamma) @ W^T in one launch: X is normalized while it is staged. w_b (v3
    only): a second matrix whose products follow W's in Y, as gemv_v3's. On repacked weights X
    may be float32 (a residual stream past fp16's range: Gemma's)."""
    check_gemv_args(x, w, qtype, n, k, wide_x=isinstance(w, Packed))
    _check_norm(gamma, eps, k)
    if isinstance(w, Packed):
        return _v3("rmsnorm", [gamma, _eps(float(eps))], x, w, qtype, n, k, knobs, w_b=w_b)
    if w_b is not None:
        raise ValueError("a pair (w_b) runs on repacked weights only (kernels.gemv.repack, the v3 GEMVs)")
    return _v2("rmsnorm", [gamma, _eps(float(eps))], x, w, qtype, n, k, _knobs(knobs))


def rmsnorm_gemv_argmax(x: mx.array, gamma: mx.array, eps: float, w: Packed, qtype: str, n: int, k: int,
                        scratch: mx.array, **knobs: int | None) -> tuple[mx.array, mx.array]:
    """rmsnorm_gemv on repacked weights that also gives each row's argmax: (Y fp16 [M, N], tokens
    int32 [M]), the token the first index of the largest value of Y's row as written (what
    kernels.loop.argmax gives over Y), in the same launch. `scratch` (head_argmax_scratch) holds a
    counter that each launch leaves zero: launches on one scratch must run one after another, which
    MLX does only where one takes what the one before gave (a decode step's token) or where an
    evaluation stands between them."""
    if not isinstance(w, Packed):
        raise ValueError("the fused argmax runs on repacked weights (kernels.gemv.repack, the v3 GEMVs)")
    check_gemv_args(x, w, qtype, n, k, wide_x=True)
    _check_norm(gamma, eps, k)
    return _v3("rmsnorm", [gamma, _eps(float(eps))], x, w, qtype, n, k, knobs, scratch=scratch)


def silu_down_gemv(gate_up: mx.array, w: mx.array, qtype: str, n: int, k: int, *,
                   residual: mx.array | None = None, activation: str = "silu", **knobs: int | None) -> mx.array:
    """(act(gate) * up) @ W^T (+ residual) with gate_up = [gate | up] as [M, 2K] (a fused
    gate+up output); act SiLU, or GELU (`activation`, ACTIVATIONS)."""
    check_gemv_args(gate_up, w, qtype, n, k, x_width=2 * k)
    _check_activation(activation)
    if isinstance(w, Packed):
        return _v3("swiglu", [], gate_up, w, qtype, n, k, knobs, residual, activation=activation)
    return _v2("swiglu", [], gate_up, w, qtype, n, k, _knobs(knobs), residual, activation)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")


# ---- v3: weights repacked when the model loads ----------------------------------------------------
@dataclass(frozen=True)
class Packed:
    """A [N, K] matrix's blocks in the v3 layout (repack): every block's quants, row after row
    (16 bytes a Q4_0 block, 32 a Q8_0 one, each in its GGUF order), then every fp16 scale in the
    same order; as many bytes as the GGUF blocks. A type of its own so that no kernel can take
    one layout for the other."""
    data: mx.array  # uint8, flat
    qtype: str
    n: int
    k: int


def repack(w: mx.array, qtype: str, n: int, k: int) -> Packed:
    """GGUF blocks [N, K/32 * block bytes] (K-quants: [N, K/256 * super-block bytes]) -> Packed:
    a byte shuffle on the device, exact (the same weights: tests/test_gemv.py against
    reference.quant.dequantize_packed, and for the K-quants the bytes of reference.kquant.pack).
    Once, when a model loads; the file is never changed. Fused matrices are concatenated first
    (concat_rows)."""
    _check_qtype_shape(qtype, n, k, V3_QTYPES)
    _check_weights(w, qtype, n, k)
    if qtype in K_QTYPES:
        return _repack_k(w, qtype, n, k)
    if qtype in LEGACY_QTYPES:
        return _repack_legacy(w, qtype, n, k)
    if qtype in IQ4_QTYPES:
        return _repack_iq4(w, qtype, n, k)
    blocks = w.reshape(n, k // 32, QTYPES[qtype][1])
    data = mx.concatenate([blocks[:, :, 2:].reshape(-1), blocks[:, :, :2].reshape(-1)])
    mx.eval(data)
    return Packed(data, qtype, n, k)


@dataclass(frozen=True)
class RowBlocks:
    """A Q4_0 or Q8_0 matrix's v3 bytes (Packed) with the 8 rows of each row block interleaved a
    super-chunk (128 values of K) at a time: chunk c of row r at ((r // 8) * K/128 + c // 4) * 32
    + (r % 8) * 4 + c % 4, the quants and then the scales in that order (interleave_rows). qmm's
    B fragments then read 512 contiguous bytes an instruction, and a row block's whole K as one
    run, where the v3 layout gives 8 pieces of 64 bytes 2 KiB apart (kernels/gemv/NOTES.md, "A
    probe of W's load order"). Only qmm takes it."""
    data: mx.array  # uint8, flat
    qtype: str
    n: int
    k: int


def interleave_rows(w: Packed) -> RowBlocks:
    """Packed Q4_0 / Q8_0 weights -> RowBlocks: a byte shuffle on the device (the same weights;
    tests/test_gemv.py against a NumPy model of the index). N must be whole row blocks of 8, K
    whole super-chunks of 128."""
    if not isinstance(w, Packed) or w.qtype not in ("q4_0", "q8_0"):
        raise ValueError(f"interleave_rows takes repacked Q4_0 or Q8_0 weights (Packed), got "
                         f"{getattr(w, 'qtype', type(w).__name__)}")
    if w.n % 8 or w.k % 128:
        raise ValueError(f"interleave_rows takes whole row blocks of 8 and super-chunks of 128: N={w.n}, K={w.k}")
    quant_bytes = 16 if w.qtype == "q4_0" else 32
    chunks = w.n * (w.k // 32)

    def shuffled(part: mx.array, width: int) -> mx.array:
        return part.reshape(w.n // 8, 8, w.k // 128, 4, width).transpose(0, 2, 1, 3, 4).reshape(-1)

    quants, scales = w.data[:chunks * quant_bytes], w.data[chunks * quant_bytes:]
    data = mx.concatenate([shuffled(quants, quant_bytes), shuffled(scales, 2)])
    mx.eval(data)
    return RowBlocks(data, w.qtype, w.n, w.k)


REPACK_ROWS = 4096  # rows a step of the K-quants' repack (its temporaries are 4 bytes a weight)


def _k_levels(blocks: mx.array, qtype: str) -> mx.array:
    """Super-blocks [rows, S, bytes] -> each weight's level [rows, S * 8, 32] (uint8; Q6_K's
    before its -32), GGML's byte layouts undone (reference.kquant.levels has the same rules)."""
    rows, s = blocks.shape[:2]
    if qtype == "q6_k":
        ql, qh = blocks[..., :128].reshape(rows, s, 2, 2, 32), blocks[..., 128:192].reshape(rows, s, 2, 32)
        low = mx.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], axis=3)
        high = mx.stack([(qh >> b) & 3 for b in (0, 2, 4, 6)], axis=3)
        return (low | (high << 4)).reshape(rows, s * 8, 32)
    qs = blocks[..., -128:].reshape(rows, s, 4, 32)
    q = mx.stack([qs & 15, qs >> 4], axis=3).reshape(rows, s, 8, 32)
    if qtype == "q5_k":
        qh = blocks[..., 16:48]
        q = q | (mx.stack([(qh >> j) & 1 for j in range(8)], axis=2) << 4)
    return q.reshape(rows, s * 8, 32)


def _high_words(levels: mx.array, qtype: str) -> mx.array:
    """The chunks' high bits as reference.kquant lays them out: Q5_K's fifth bit of value 4t + b at
    bit 8b + t of one word (of 16 + 4t + b at 8b + 4 + t), Q6_K's bits 4-5 of value 16s + 4t + b at
    bits 8b + 2t of word s. Returned as the words' bytes."""
    v = mx.arange(16)
    t, b = v // 4, v % 4
    high = (levels >> 4).astype(mx.uint32).reshape(*levels.shape[:2], 2, 16)
    if qtype == "q5_k":
        pos = mx.stack([8 * b + t, 8 * b + 4 + t]).astype(mx.uint32)
        words = (high << pos).sum(axis=(-2, -1))  # no two values share a bit: the sum is an or
    else:
        words = (high << (8 * b + 2 * t).astype(mx.uint32)).sum(axis=-1)
    return words.astype(mx.uint32).view(mx.uint8).reshape(-1)


def _repack_k(w: mx.array, qtype: str, n: int, k: int) -> Packed:
    """The K-quants' repack (reference/kquant.py's layout): low nibbles of each chunk of 32 in
    Q4_0's order, then the chunks' high bits, then the scales (Q4_K/Q5_K each super-block's first
    16 bytes; Q6_K its int8 scales, then every d), in steps of REPACK_ROWS rows (the levels and
    high-bit words are temporaries of a few bytes a weight)."""
    sb = K_QTYPES[qtype][1]
    blocks = w.reshape(n, k // 256, sb)
    quants, high, heads, ds = [], [], [], []
    for r0 in range(0, n, REPACK_ROWS):
        part = blocks[r0:r0 + REPACK_ROWS]
        levels = _k_levels(part, qtype)
        quants.append(((levels[..., :16] & 15) | ((levels[..., 16:] & 15) << 4)).reshape(-1))
        if qtype != "q4_k":
            high.append(_high_words(levels, qtype))
        if qtype == "q6_k":
            heads.append(part[..., 192:208].reshape(-1))
            ds.append(part[..., 208:210].reshape(-1))
        else:
            heads.append(part[..., :16].reshape(-1))
        mx.eval(quants[-1], *high[-1:], heads[-1], *ds[-1:])
    data = mx.concatenate(quants + high + heads + ds)
    mx.eval(data)
    return Packed(data, qtype, n, k)


def _repack_legacy(w: mx.array, qtype: str, n: int, k: int) -> Packed:
    """Q4_1, Q5_0, Q5_1 in the K-quants' regions (reference.quant.pack_legacy): each block's 16
    bytes of nibbles as GGUF has them (Q4_0's order), its fifth bits moved to Q5_K's places
    (_high_words), then each block's d (Q5_0) or d and m, side by side."""
    bb = LEGACY_QTYPES[qtype][1]
    blocks = w.reshape(n * (k // 32), bb)
    heads = 2 if qtype == "q5_0" else 4  # d, or d and m, first in the block
    parts = [blocks[:, bb - 16:].reshape(-1)]
    if qtype != "q4_1":
        qh = blocks[:, heads:heads + 4].reshape(-1, 4).astype(mx.uint32)
        word = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
        fifth = ((word[:, None] >> mx.arange(32, dtype=mx.uint32)) & 1).astype(mx.uint8)
        parts.append(_high_words((fifth << 4).reshape(1, -1, 32), "q5_k"))
    parts.append(blocks[:, :heads].reshape(-1))
    data = mx.concatenate(parts)
    mx.eval(data)
    return Packed(data, qtype, n, k)


def _repack_iq4(w: mx.array, qtype: str, n: int, k: int) -> Packed:
    """IQ4_NL, IQ4_XS in the K-quants' regions (reference.iquant.pack): every chunk of 32 weights'
    16 bytes of nibbles as GGUF has them, then IQ4_NL's d a block, or IQ4_XS's 8-byte head of each
    super-block (d, scales_h, scales_l) as GGUF has it."""
    _, per_block, bb = IQ4_QTYPES[qtype]
    blocks = w.reshape(n * (k // per_block), bb)
    head = bb - per_block // 2  # the bytes before the nibbles: 2 (d), or 8
    data = mx.concatenate([blocks[:, head:].reshape(-1), blocks[:, :head].reshape(-1)])
    mx.eval(data)
    return Packed(data, qtype, n, k)


def unpack(p: Packed) -> mx.array:
    """Packed -> the GGUF blocks again: repack's inverse for Q4_0/Q8_0 (tests/test_gemv.py checks
    the round trip; the K-quants' layout is checked against reference.kquant.pack instead)."""
    if p.qtype not in QTYPES:
        raise ValueError(f"unpack takes Q4_0/Q8_0 (the K-quants' layout is reference.kquant's), got {p.qtype}")
    nb, bb = p.k // 32, QTYPES[p.qtype][1]
    quants = p.data[: p.n * nb * (bb - 2)].reshape(p.n, nb, bb - 2)
    scales = p.data[p.n * nb * (bb - 2):].reshape(p.n, nb, 2)
    return mx.concatenate([scales, quants], axis=2).reshape(p.n, nb * bb)


def _check_packed(w: Packed, qtype: str, n: int, k: int) -> None:
    if (w.qtype, w.n, w.k) != (qtype, n, k):
        raise ValueError(f"packed weights are {w.qtype} [N={w.n}, K={w.k}], the call says {qtype} [N={n}, K={k}]")


def v3_smem_bytes(m: int, xchunk: int, simds: int, rms_late: bool = False) -> int:
    """Threadgroup memory of a v3 launch: X' as int16, a scale and a sum per block, each row's
    1 / RMS, and the threadgroup sum's scratch (rms_late: a float a SIMD group and row)."""
    return m * (2 * xchunk + xchunk // 32 * 8) + 4 * (m + simds * (m if rms_late else 1))


def v3_by_shape(n: int, k: int, qtype: str = "q4_0") -> dict[str, int]:
    """v3's knobs for an [N, K] matrix, from the projection chain on the H200, where each GEMV
    waits for the one before as in the decode loop (harness.tools.gemv_chain; logs/gemv-chain-v3-54a13a3.log,
    both formats): long rows (down, K = 14336) take 8 SIMD groups a threadgroup, which share one
    staged X'; many rows (gate+up, heads) a grid of one wave, 4 threadgroups on each of the 132
    SMs, each SIMD group streaming its row groups; QKV (6144 rows) 4 rows a SIMD group; the rest
    (O, 4096 rows) 8 SIMD groups of 2 rows.
    The K-quants with V3_K_SHAPES 1 (the default): 2 rows of 4 SIMD groups on a grid of 264 (2 a
    SM), the sweep of isolated calls' best (logs/sweep-gemv-k-a0a8927.log), where it does not lose
    in the chain:
    - Q6_K on the QKV-like shapes (4096 < N < 16384, K < 8192): in the chain too, the 8B Q6_K
      token's QKV 14.4 -> 11.5 us, its span 2.36 -> 2.27 ms; Q5_K's QKV 0.5 us slower, so not
      Q5_K there, and the other choices slower for every K type (logs/gemv-chain-k-d9f8937.log,
      gemv-chain-k-cf23fda.log);
    - every K-quant past 8192 rows and below 16384 (an unfused gate or up, 14336 x 4096): Q5_K
      13.0 -> 10.3 us there, Q4_K 8.6 -> 7.6. No GEMV of the 8B or 0.6B chains has such a shape
      (gate+up is 28672 rows, QKV 6144), so the chain neither confirms nor refutes it."""
    if qtype in K_QTYPES and TUNING["V3_K_SHAPES"] and k < 8192 and (8192 < n < 16384
                                                                      or qtype == "q6_k" and 4096 < n < 16384):
        return dict(R=2, NSIMD=4, P=4, G=264)
    if k >= 8192:
        return dict(R=2, NSIMD=8, P=4, G=0)
    if n >= 16384:
        return dict(R=2, NSIMD=4, P=4, G=528)
    if n > 4096:
        return dict(R=4, NSIMD=4, P=4, G=0)
    return dict(R=2, NSIMD=8, P=4, G=0)


@_per_budget
def v3_geometry(qtype: str, m: int, n: int, k: int, rows: int | None = None, simds: int | None = None,
                depth: int | None = None, *, budget: int) -> tuple[int, int, int, int]:
    """(R, NSIMD, P, XCHUNK) of a v3 launch: the tuned (or given) R and NSIMD, halved (NSIMD
    first) where the matrix would give fewer than MIN_GROUPS threadgroups; P (16-byte loads a
    lane issues per row before using any) at most a lane's share of a row; all of K staged at
    once where it fits, else the largest multiple of 2048 values that does."""
    tuning, shaped = TUNING[qtype], v3_by_shape(n, k, qtype)
    r, s = _fill_groups(n, rows or tuning["V3_R"] or shaped["R"], simds or tuning["V3_NSIMD"] or shaped["NSIMD"],
                        rows, simds)
    xchunk = k
    while v3_smem_bytes(m, xchunk, s) > budget:
        xchunk = (xchunk - 1) // 2048 * 2048
    if xchunk <= 0:
        raise ValueError(f"M={m} rows of X do not fit in threadgroup memory in chunks of 2048")
    p = max(1, min(depth or tuning["V3_P"] or shaped["P"], lane_loads(qtype, xchunk)))
    return r, s, p, xchunk


def lane_loads(qtype: str, values: int) -> int:
    """16-byte loads of W a lane takes over `values` of a row, its SIMD group's 32 lanes sharing
    the row (a load: 16 Q8_0 values, 32 of the other types')."""
    return -(-(values // (16 if qtype == "q8_0" else 32)) // 32)


def _check_pair(w: Packed, w_b: Packed, k: int) -> None:
    """A second matrix for gemv_v3.metal's pair: repacked, of K columns, any block type (each
    GEMV reads the launch's X' in its own chunks: v3_rows.metal)."""
    if not isinstance(w_b, Packed):
        raise ValueError("w_b must be repacked weights (kernels.gemv.repack, Packed), as w")
    if w_b.k != k:
        raise ValueError(f"w_b has K={w_b.k}, W has K={k}: a pair shares X")


def _v3_groups(qtype: str, n: int, k: int, r: int, s: int, xchunk: int, cap: int | None = None) -> int:
    """Threadgroups of a v3 GEMV's N rows at R rows a SIMD group and NSIMD s: one row group a SIMD
    group, or at most `cap` (None: TUNING's V3_MAX_GROUPS, else v3_by_shape's; 0: none), each SIMD
    group then streaming its row groups, which needs X' staged once (all of K in one chunk)."""
    groups = -(-n // (r * s))
    cap = (TUNING["V3_MAX_GROUPS"] or v3_by_shape(n, k, qtype)["G"]) if cap is None else cap
    if cap < 0:
        raise ValueError(f"max_groups must be >= 0, got {cap}")
    return min(groups, cap) if cap and xchunk >= k else groups


def row_passes() -> bool:
    """v3_rows.metal's GEMV_ROW_PASSES (a launch's ROW_PASSES constant): a lane's passes over a row
    stop at the row's own chunks (the gemv_row_passes option)."""
    return options.get("gemv_row_passes") == "row"


def x_stage_items(option: str, rows: int) -> int:
    """x_stage.metal's X_STAGE_ITEMS (X' items a thread stages a pass) from `option` (gemv_x_items,
    block_x_items); unset (auto): 2 past 4 rows of X, else 1 (block_x_items' text says why)."""
    items = options.get(option)
    if items is None:
        items = 2 if rows > 4 else 1
    if not 1 <= items <= 8:  # (0 would never end the staging's loop)
        raise ValueError(f"{option} must be 1..8 (X' items a thread stages a pass), got {items}")
    return items


def _v3(prologue: str, inputs: list[mx.array], x: mx.array, w: Packed, qtype: str, n: int, k: int,
        knobs: dict, residual: mx.array | None = None, swiglu_out: bool = False,
        w_b: Packed | None = None, activation: str = "silu",
        scratch: mx.array | None = None) -> mx.array | tuple[mx.array, mx.array]:
    if not isinstance(w, Packed):
        raise ValueError("v3 takes weights repacked by kernels.gemv.repack (Packed), not GGUF blocks")
    m = x.shape[0]
    if w_b is not None:
        _check_pair(w, w_b, k)
        if residual is not None or swiglu_out:
            raise ValueError("a pair (w_b) writes two matrices' products side by side: no residual, no SwiGLU out")
    n_out = n // 2 if swiglu_out else n  # columns of Y
    if residual is not None:
        _check_residual(residual, m, n_out)
        inputs = [*inputs, residual]
    unknown = set(knobs) - {"rows", "simds", "depth", "max_groups"}
    if unknown:
        raise ValueError(f"unknown launch knobs {sorted(unknown)}: rows, simds, depth, max_groups")
    rows = knobs.get("rows")
    if swiglu_out and rows is not None and rows % 2:
        raise ValueError(f"SwiGLU out pairs each gate row with its up row in one SIMD group: rows must be even, got {rows}")
    r, s, p, xchunk = v3_geometry(qtype, m, n, k, rows, knobs.get("simds"), knobs.get("depth"))
    if swiglu_out and r % 2:  # small matrices halve R to 1: keep a pair
        r, s, p, xchunk = v3_geometry(qtype, m, n, k, r + 1, s, p)
    groups = _v3_groups(qtype, n, k, r, s, xchunk, knobs.get("max_groups"))
    consts = dict(QTYPE=block_format(qtype)[0], M=m, R=r, NSIMD=s, P=p, K=k, XCHUNK=xchunk,
                  XITEMS=x_stage_items("gemv_x_items", m))
    launched, n_y, pair = groups, n_out, []
    if w_b is not None:  # W_B's rows after W's: its own R, P and grid at the launch's NSIMD (and X')
        r_b, _, p_b, _ = v3_geometry(w_b.qtype, m, w_b.n, k, None, s)
        groups_b = _v3_groups(w_b.qtype, w_b.n, k, r_b, s, xchunk)
        consts.update(QTYPE_B=block_format(w_b.qtype)[0], R_B=r_b, P_B=p_b)
        launched, n_y, pair = groups + groups_b, n_out + w_b.n, [w_b.data, _dims(w_b.n, k, groups_b)]
    wide_x = x.dtype == mx.float32  # the RMSNorm prologue over a float32 stream (check_gemv_args)
    argmax = scratch is not None
    if argmax:
        _check_scratch(scratch, argmax_scratch_words(m, groups))
    outs = launch(Launch(_gemv_spec("v3", prologue, residual is not None, swiglu_out, w_b is not None,
                                    activation, wide_x, argmax),
                         [x, w.data, _dims(n, k, groups), *inputs, *pair, *((scratch,) if argmax else ())],
                         [((m, n_y), mx.float16)] + ([((m,), mx.int32)] if argmax else []),
                         (launched * 32 * s, 1, 1), (32 * s, 1, 1), consts))
    return tuple(outs) if argmax else outs[0]


def argmax_scratch_words(m: int, groups: int) -> int:
    """uint32 words of a fused argmax's scratch (gemv_v3.metal's LATHE_ARGMAX): a counter on a
    256-byte line of its own, then a (value, index) pair a row for each threadgroup."""
    return 64 + 2 * m * groups


def head_argmax_scratch(qtype: str, n: int, k: int, m: int = 1, **knobs: int | None) -> mx.array:
    """A zeroed scratch for rmsnorm_gemv_argmax over an [N, K] matrix of `qtype` and M rows (the
    launch's grid as the same knobs and TUNING give it), resident on the device."""
    r, s, _, xchunk = v3_geometry(qtype, m, n, k, knobs.get("rows"), knobs.get("simds"), knobs.get("depth"))
    groups = _v3_groups(qtype, n, k, r, s, xchunk, knobs.get("max_groups"))
    return resident(mx.zeros((argmax_scratch_words(m, groups),), mx.uint32))


def _check_scratch(scratch: mx.array, words: int) -> None:
    if not isinstance(scratch, mx.array) or scratch.dtype != mx.uint32 or scratch.ndim != 1:
        raise ValueError(f"scratch must be a uint32 vector (head_argmax_scratch), got "
                         f"{getattr(scratch, 'dtype', type(scratch))} {tuple(getattr(scratch, 'shape', ()))}")
    if scratch.size < words:
        raise ValueError(f"this launch's argmax needs a scratch of {words} words (its threadgroups' slots), "
                         f"got {scratch.size}: make it with head_argmax_scratch for the same shape and knobs")


def gemv_v3(x: mx.array, w: Packed, qtype: str, n: int, k: int, *, residual: mx.array | None = None,
            w_b: Packed | None = None, **knobs: int | None) -> mx.array:
    """Y[M, N] = X[M, K] @ W^T (+ residual), W repacked (repack), M 1..4. Launch knobs (TUNING's
    V3_ ones when not given, W's only): rows (R), simds (NSIMD), depth (P), max_groups.
    w_b: a second repacked matrix [N_B, K] of a block type of its own: Y is then [M, N + N_B], X @ W^T then X @ W_B^T, in one launch (no residual)."""
    check_gemv_args(x, w, qtype, n, k)
    return _v3("plain", [], x, w, qtype, n, k, knobs, residual, w_b=w_b)


def gate_up_swiglu(x: mx.array, w: Packed, qtype: str, n: int, k: int, *, gamma: mx.array | None = None,
                   eps: float | None = None, activation: str = "silu", **knobs: int | None) -> mx.array:
    """silu(X' @ W_gate^T) * (X' @ W_up^T) -> [M, n / 2] in one launch: W = [gate; up] (concat_rows
    of the two, repacked: n = 2F rows), X' = X, or RMSNorm(X) * gamma with `gamma` and `eps`.
    The FFN's activation rides in the gate+up GEMV's epilogue (each SIMD group holds gate row i
    and up row i), so the down projection after it is a plain GEMV over [M, F]. v3 only (Packed
    weights); knobs as gemv_v3's, rows even. `activation`: SiLU, or GELU (GeGLU: Gemma); X may
    be float32 with the RMSNorm prologue (rmsnorm_gemv's)."""
    check_gemv_args(x, w, qtype, n, k, wide_x=gamma is not None)
    _check_activation(activation)
    if not isinstance(w, Packed):
        raise ValueError("gate_up_swiglu runs on repacked weights (kernels.gemv.repack), not GGUF blocks")
    if n % 2:
        raise ValueError(f"W must be [gate; up], an even number of rows, got N={n}")
    if (gamma is None) != (eps is None):
        raise ValueError("the RMSNorm prologue takes both gamma and eps")
    if gamma is None:
        return _v3("plain", [], x, w, qtype, n, k, knobs, swiglu_out=True, activation=activation)
    _check_norm(gamma, eps, k)
    return _v3("rmsnorm", [gamma, _eps(float(eps))], x, w, qtype, n, k, knobs, swiglu_out=True,
               activation=activation)


def gemv(x: mx.array, w: mx.array | Packed, qtype: str, n: int, k: int, *,
         residual: mx.array | None = None) -> mx.array:
    """The GEMV for the weights' layout: v2 on GGUF blocks, v3 on Packed ones."""
    fn = gemv_v3 if isinstance(w, Packed) else gemv_v2
    return fn(x, w, qtype, n, k, residual=residual)


# ---- the seam: two GEMVs in one launch ---------------------------------------------------------------
@functools.cache
def _seam_spec(prologue: str, v3: bool = False) -> KernelSpec:
    return KernelSpec(f"lathe_seam_{'v3_' if v3 else ''}{prologue}", "gemv/seam.metal",
                      ("a_x", "a_w", "a_dims", "residual", "gamma", "eps", "b_w", "b_dims", "queue"),
                      ("a_y", "b_y"), prelude=f"#define PROLOGUE_A {PROLOGUES[prologue]}\n"
                                              f"#define SEAM_V3 {int(v3)}",
                      threadgroup_bytes=_seam_v3_threadgroup_bytes if v3 else _seam_v2_threadgroup_bytes)


def _seam_v2_threadgroup_bytes(c: dict) -> int:
    return _v2_threadgroup_bytes(c) + 4  # the GEMVs' arrays and the ticket a threadgroup claims


def _seam_v3_threadgroup_bytes(c: dict) -> int:
    return _v3_threadgroup_bytes(c) + 4


SEAM_QUEUE = 3 * 64  # gemv/seam.metal's counters, each on a 256-byte line of its own


def seam_queue() -> mx.array:
    """The work counters of one seam launch site (gemv/seam.metal): zero, on the device. A
    launch leaves them zero; two launches in flight at once must not share one."""
    return resident(mx.zeros((SEAM_QUEUE,), mx.uint32))


@_per_budget  # pure; called for every seam launch (set_tuning clears it)
def seam_geometry(qtype: str, m: int, n_a: int, k_a: int, n_b: int, rows: int | None = None,
                  simds: int | None = None, slots: int | None = None, *, budget: int) -> tuple[int, int, int, int]:
    """(R, NSIMD, XCHUNK, SLOTS) shared by a seam's two GEMVs (one set of threadgroup memory):
    the smaller of their own R and NSIMD, the chunk of X that fits for the longer K, and
    SEAM_SLOTS (or the given slots) only where both GEMVs take them with all of K in one chunk."""
    slots = TUNING["SEAM_SLOTS"] if slots is None else slots
    geo_a = v2_geometry(qtype, m, n_a, k_a, rows, simds)
    geo_b = v2_geometry(qtype, m, n_b, n_a, rows, simds)
    r, s = min(geo_a[0], geo_b[0]), min(geo_a[1], geo_b[1])
    k = max(k_a, n_a)
    slots = min(v2_slots(qtype, k_a, slots), v2_slots(qtype, n_a, slots))
    if slots and v2_smem_bytes(qtype, m, r, s, -(-k // 2048) * 2048, slots) > budget:
        slots = 0
    return v2_geometry(qtype, m, 1, k, rows=r, simds=s, slots=slots)


def seam(x: mx.array, w_a: mx.array | Packed, n_a: int, k_a: int, residual: mx.array, gamma: mx.array,
         eps: float, w_b: mx.array | Packed, n_b: int, qtype: str, *, swiglu: bool = False,
         queue: mx.array | None = None, **knobs: int | None) -> tuple[mx.array, mx.array]:
    """(a_y, b_y) in one launch: a_y = residual + X' @ W_a^T, X' = X (or silu(gate) * up of
    X = [gate | up] with `swiglu`), then b_y = (RMSNorm(a_y) * gamma) @ W_b^T: a decoder layer's
    output projection and the next block's normed input projection (gemv/seam.metal). `queue`:
    this launch site's counters (seam_queue); a fresh one when not given. Launch knobs as
    gemv_v2's, `launched`: threadgroups launched (default: the larger GEMV's count; at least
    GEMV B's), and `prefetch`: B's first weights issued before the wait (default: SEAM_PREFETCH
    where the seam takes no slots). On Packed weights the seam is v3's (its knobs: rows, simds,
    depth, launched, prefetch). Where one launch may not wait on another's threadgroups (Metal:
    kernels.backends.cross_group_waits), the two GEMVs run as two launches, the knobs unused."""
    unknown = set(knobs) - {"rows", "simds", "slots", "max_groups", "launched", "prefetch"}
    if unknown and not isinstance(w_a, Packed):
        raise ValueError(f"unknown launch knobs {sorted(unknown)}: rows, simds, slots, max_groups, "
                         "launched, prefetch")
    check_gemv_args(x, w_a, qtype, n_a, k_a, x_width=2 * k_a if swiglu else None)
    _check_qtype_shape(qtype, n_b, n_a, V3_QTYPES)  # GEMV B's K is A's N (K types: Packed, checked above)
    _check_weights(w_b, qtype, n_b, n_a)
    if isinstance(w_a, Packed) != isinstance(w_b, Packed):
        raise ValueError("a seam's two matrices must be in one layout: both GGUF blocks or both Packed")
    m = x.shape[0]
    _check_residual(residual, m, n_a)
    _check_norm(gamma, eps, n_a)
    if queue is None:
        queue = mx.zeros((SEAM_QUEUE,), mx.uint32)
    if not isinstance(queue, mx.array) or queue.dtype != mx.uint32 or queue.shape != (SEAM_QUEUE,):
        raise ValueError(f"queue must be uint32 [{SEAM_QUEUE}] (seam_queue()), got "
                         f"{getattr(queue, 'dtype', type(queue))} {getattr(queue, 'shape', '')}")
    if not backends.cross_group_waits():  # Metal: B may not wait on A's threadgroups in one launch
        a_y = (silu_down_gemv if swiglu else gemv)(x, w_a, qtype, n_a, k_a, residual=residual)
        return a_y, rmsnorm_gemv(a_y, gamma, eps, w_b, qtype, n_b, n_a)
    if isinstance(w_a, Packed):
        return _seam_v3(x, w_a, n_a, k_a, residual, gamma, eps, w_b, n_b, qtype, swiglu, queue, knobs)
    r, s, xchunk, slots = seam_geometry(qtype, m, n_a, k_a, n_b, knobs.get("rows"), knobs.get("simds"),
                                        knobs.get("slots"))
    cap = knobs.get("max_groups")
    cap = (TUNING["MAX_GROUPS"] if slots else TUNING["SEAM_GROUPS"]) if cap is None else cap
    tickets_a = v2_groups(n_a, k_a, r, s, xchunk, cap)
    tickets_b = v2_groups(n_b, n_a, r, s, xchunk, cap)
    launched = knobs.get("launched")
    launched = max(tickets_a, tickets_b) if launched is None else launched
    if launched < tickets_b:  # B's threadgroups are the launched ones (gemv/seam.metal)
        raise ValueError(f"launched must be at least GEMV B's {tickets_b} threadgroups, got {launched}")
    prefetch = knobs.get("prefetch")
    prefetch = bool(TUNING["SEAM_PREFETCH"]) and not slots if prefetch is None else bool(prefetch)
    consts = dict(QTYPE=QTYPES[qtype][0], M=m, R=r, NSIMD=s,
                  ALIGNED=(k_a // 32) % 8 == 0 and (n_a // 32) % 8 == 0, XCHUNK=xchunk, SLOTS=slots,
                  PREFETCH=prefetch)
    a_y, b_y = launch(Launch(
        _seam_spec("swiglu" if swiglu else "plain"),
        [x, w_a.reshape(-1), _dims(n_a, k_a, tickets_a, launched), residual, gamma, _eps(float(eps)),
         w_b.reshape(-1), _dims(n_b, n_a, tickets_b), queue],
        [((m, n_a), mx.float16), ((m, n_b), mx.float16)],
        (launched * 32 * s, 1, 1), (32 * s, 1, 1), consts))
    return a_y, b_y


def _seam_v3(x, w_a: Packed, n_a, k_a, residual, gamma, eps, w_b: Packed, n_b, qtype, swiglu, queue,
             knobs) -> tuple[mx.array, mx.array]:
    """The seam of two v3 GEMVs (gemv/seam.metal with SEAM_V3): GEMV A's R, NSIMD and P for both
    (one set of threadgroup memory, X' chunks sized for the longer K); where all of a GEMV's K is
    one chunk, A's grid capped by shape (v3_by_shape), B's at SEAM_V3_WARPS SIMD groups."""
    unknown = set(knobs) - {"rows", "simds", "depth", "launched", "prefetch"}
    if unknown:
        raise ValueError(f"unknown launch knobs {sorted(unknown)} for a v3 seam: rows, simds, depth, "
                         "launched, prefetch")
    m = x.shape[0]
    r, s, p, _ = v3_geometry(qtype, m, n_a, k_a, knobs.get("rows"), knobs.get("simds"), knobs.get("depth"))
    _, _, _, xchunk = v3_geometry(qtype, m, 1, max(k_a, n_a), r, s, p)

    def tickets(n: int, k: int, warps: int = 0) -> int:
        cap = TUNING["V3_MAX_GROUPS"] or (warps // s if warps else v3_by_shape(n, k, qtype)["G"])
        groups = -(-n // (r * s))
        return min(groups, cap) if cap and xchunk >= k else groups

    tickets_a, tickets_b = tickets(n_a, k_a), tickets(n_b, n_a, TUNING["SEAM_V3_WARPS"])
    launched = knobs.get("launched")
    launched = max(tickets_a, tickets_b) if launched is None else launched
    if launched < tickets_b:  # B's threadgroups are the launched ones (gemv/seam.metal)
        raise ValueError(f"launched must be at least GEMV B's {tickets_b} threadgroups, got {launched}")
    prefetch = knobs.get("prefetch")
    prefetch = bool(TUNING["SEAM_PREFETCH"]) if prefetch is None else bool(prefetch)
    consts = dict(QTYPE=block_format(qtype)[0], M=m, R=r, NSIMD=s, P=p, XCHUNK=xchunk, K_A=k_a, K_B=n_a,
                  PREFETCH=prefetch, ROW_PASSES=row_passes())
    a_y, b_y = launch(Launch(
        _seam_spec("swiglu" if swiglu else "plain", v3=True),
        [x, w_a.data, _dims(n_a, k_a, tickets_a, launched), residual, gamma, _eps(float(eps)),
         w_b.data, _dims(n_b, n_a, tickets_b), queue],
        [((m, n_a), mx.float16), ((m, n_b), mx.float16)],
        (launched * 32 * s, 1, 1), (32 * s, 1, 1), consts))
    return a_y, b_y


# ---- quantize and dequantize on the GPU -----------------------------------------------------------
def quantize(w: mx.array, qtype: str, check_finite: bool = True) -> mx.array:
    """fp16 [N, K] -> [N, K/32 * block bytes] uint8 blocks, the bytes of reference.quant."""
    _check_fp16("w", w)
    if w.ndim != 2:
        raise ValueError(f"w must be [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    _check_qtype_shape(qtype, n, k)
    if n * k > 2**31 - 1:
        raise ValueError("the kernels index with 32-bit integers: the matrix is too large")
    if check_finite and not mx.all(mx.isfinite(w)).item():  # one evaluation, before the launch
        raise ValueError("w has NaN or inf: GGUF blocks cannot hold them")
    code, bb = QTYPES[qtype]
    blocks = n * (k // 32)
    (q,) = launch(Launch(_QUANTIZE, [w, _dims(n, k)], [((n, k // 32 * bb), mx.uint8)],
                         (-(-blocks // 256) * 256, 1, 1), (256, 1, 1), dict(QTYPE=code)))
    return q


def dequantize(q: mx.array | Packed, qtype: str, n: int, k: int) -> mx.array:
    """[N, K/32 * block bytes] blocks, or Packed -> fp16 [N, K] (each value (q - 8) d or q d, rounded once).
    The K-quants too: [N, K/256 * super-block bytes] -> fp16 [N, K]; and Q4_1, Q5_0, Q5_1."""
    _check_qtype_shape(qtype, n, k, V3_QTYPES)
    _check_weights(q, qtype, n, k)
    packed = isinstance(q, Packed)
    # a thread 32 weights (a block, or part of a K-quant super-block), or 8 of a repacked Q4_0/Q8_0
    # block (DEQUANT_SPLIT 4: coalesced stores, dequantize.metal)
    split = TUNING["DEQUANT_SPLIT"] if packed and qtype in QTYPES else 1
    if split not in (1, 4):
        raise ValueError(f"DEQUANT_SPLIT must be 1 or 4, got {split}")
    threads = n * (k // 32) * split
    (w,) = launch(Launch(_DEQUANTIZE, [(q.data if packed else q).reshape(-1), _dims(n, k)], [((n, k), mx.float16)],
                         (-(-threads // 256) * 256, 1, 1), (256, 1, 1),
                         dict(QTYPE=block_format(qtype)[0], PACKED=int(packed), SPLIT=split)))
    return w


# ---- a few rows of X: the quantized GEMM -------------------------------------------------------------
QMM_MAX_M = 64  # rows of X the quantized GEMM takes (a short prompt's)
# linear() takes qmm up to this many rows: with the half2 decode and its knobs from the sweep (10cb374,
# H100) 64 rows of the 8B's 4096 x 4096 took 11.6 us against about 37 for dequantize + MLX's matmul
# (kernels/gemv/NOTES.md)
QMM_UP_TO = QMM_MAX_M


def _qmm_spec(residual: bool, norm: bool = False, activation: str | None = None) -> KernelSpec:
    """qmm.metal: plain, + residual, with the RMSNorm prologue (`norm`), and/or gated (act(gate) *
    up of a [gate; up] matrix, `activation`)."""
    name = "lathe_qmm" + ("_norm" if norm else "") + (f"_{activation}" if activation else "")
    return KernelSpec(name + ("_residual" if residual else ""), "gemv/qmm.metal",
                      ("x", "w", "dims", *(("gamma", "eps") if norm else ()), *(("residual",) if residual else ())),
                      ("y",), prelude=f"#define LATHE_SPLIT 0\n#define LATHE_RESIDUAL {int(residual)}\n"
                                      f"#define LATHE_NORM {int(norm)}\n#define LATHE_GATED {int(activation is not None)}\n"
                                      f"#define LATHE_ACT {ACTIVATIONS.get(activation, 0)}",
                      threadgroup_bytes=_qmm_threadgroup_bytes(norm))


def qmm_smem_bytes(mp: int, nb: int, wn: int, wk: int, norm: bool = False, xs: int = 0, w_ring: int = 0,
                   wr: int = 1) -> int:
    """qmm.metal's threadgroup arrays: the partial sums of the WK - 1 groups that hand theirs to the
    first; with the RMSNorm prologue, each row's 1 / rms; with xs buffers of staged X, each MP rows
    of WK super-chunks (16 pieces of 16 bytes each) and 2 pieces of padding a row (unstaged, the
    array's one piece); W's ring (knob wr) of `w_ring` 16-byte words a chunk (Q4_0 1, Q8_0 2; 0: no
    ring): a slot a buffer of X with xs, else wr + 1 slots, each of every thread's NB chunks and
    the 4-byte words of their d (without it, the arrays' one element each)."""
    staged = (xs * mp * (16 * wk + 2) if xs else 1) * 16
    slots = xs or wr + 1
    ring = slots * nb * 32 * wn * wk * (16 * w_ring + 4) if w_ring else 16 + 4
    return 4 * max(1, (wk - 1) * wn * nb * (mp // 8) * 64) + (4 * mp if norm else 0) + staged + ring


def qmm_ring_words(qtype_code: int, wr: int) -> int:
    """W's 16-byte words a chunk in qmm's ring: Q4_0 (code 0) 1, Q8_0 (code 1) 2; 0 where the
    launch has no ring (wr 0, or another block type, whose loads stay as they are)."""
    return (1 if qtype_code == 0 else 2) if wr and qtype_code <= 1 else 0


def _qmm_threadgroup_bytes(norm: bool):
    return lambda c: qmm_smem_bytes(c["MP"], c["NB"], c["WN"], c["WK"], norm, c["XS"],
                                    qmm_ring_words(c["QTYPE"], c["WR"]), c["WR"])


_QMM = {(residual, norm, act): _qmm_spec(residual, norm, act) for residual in (False, True) for norm in (False, True)
        for act in (None, *ACTIVATIONS) if not (residual and act)}


def _qmm_split_spec(norm: bool, gated: bool) -> KernelSpec:
    """qmm.metal with K split over threadgroups (LATHE_SPLIT): float32 partial sums out; the
    epilogue is qmm_reduce's."""
    return KernelSpec("lathe_qmm_split" + ("_norm" if norm else "") + ("_gated" if gated else ""), "gemv/qmm.metal",
                      ("x", "w", "dims", *(("gamma", "eps") if norm else ())), ("part",),
                      prelude=f"#define LATHE_SPLIT 1\n#define LATHE_RESIDUAL 0\n#define LATHE_NORM {int(norm)}\n"
                              f"#define LATHE_GATED {int(gated)}\n#define LATHE_ACT 0",
                      threadgroup_bytes=_qmm_threadgroup_bytes(norm))


def _qmm_reduce_spec(residual: bool, activation: str | None) -> KernelSpec:
    """qmm_reduce.metal: a split qmm's partial sums added, then its epilogue."""
    return KernelSpec("lathe_qmm_reduce" + (f"_{activation}" if activation else "") + ("_residual" if residual else ""),
                      "gemv/qmm_reduce.metal", ("part", "dims", *(("residual",) if residual else ())), ("y",),
                      prelude=f"#define LATHE_RESIDUAL {int(residual)}\n"
                              f"#define LATHE_GATED {int(activation is not None)}\n"
                              f"#define LATHE_ACT {ACTIVATIONS.get(activation, 0)}")


def _qmm_last_spec(residual: bool, norm: bool, activation: str | None) -> KernelSpec:
    """qmm.metal with K split and the parts added by each row block's last threadgroup (LATHE_LAST):
    the site's counters in, the parts and Y out, qmm's epilogue."""
    name = "lathe_qmm_split_last" + ("_norm" if norm else "") + (f"_{activation}" if activation else "")
    return KernelSpec(name + ("_residual" if residual else ""), "gemv/qmm.metal",
                      ("x", "w", "dims", *(("gamma", "eps") if norm else ()), "counters",
                       *(("residual",) if residual else ())), ("part", "y"),
                      prelude=f"#define LATHE_SPLIT 1\n#define LATHE_LAST 1\n#define LATHE_RESIDUAL {int(residual)}\n"
                              f"#define LATHE_NORM {int(norm)}\n#define LATHE_GATED {int(activation is not None)}\n"
                              f"#define LATHE_ACT {ACTIVATIONS.get(activation, 0)}",
                      threadgroup_bytes=lambda c: _qmm_threadgroup_bytes(norm)(c) + 4)  # + the last flag


_QMM_SPLIT = {(norm, gated): _qmm_split_spec(norm, gated) for norm in (False, True) for gated in (False, True)}
_QMM_LAST = {(residual, norm, act): _qmm_last_spec(residual, norm, act) for residual in (False, True)
             for norm in (False, True) for act in (None, *ACTIVATIONS) if not (residual and act)}
_QMM_REDUCE = {(residual, act): _qmm_reduce_spec(residual, act) for residual in (False, True)
               for act in (None, *ACTIVATIONS) if not (residual and act)}
# The adding launch that also writes the next block's RMSNorm of the residual stream (next_norm):
# a threadgroup a row, of at least QMM_REDUCE_NSIMD SIMD groups (kernels.loop's rmsnorm NSIMD, so
# that up to 1024 values a row its sums are that launch's; kernels.gemv does not import
# kernels.loop: tests/test_imports.py)
QMM_REDUCE_NSIMD = 4


def qmm_reduce_nsimd(n: int) -> int:
    """The SIMD groups of next_norm's adding launch for rows of N values: one 8-value word a thread
    up to the backend's threads a threadgroup (CUDA 32 groups, Metal 8). With rmsnorm's 4 (b98757c,
    H200) the 8B's steps of 8 took 8.7 us a launch for its 8 threadgroups, each thread's KS parts
    of 4 words one after another: more than the rmsnorm launch and the adding launch it replaced
    (kernels/loop/NOTES.md)."""
    return min(backends.threads_per_threadgroup() // 32, max(QMM_REDUCE_NSIMD, -(-(n // 8) // 32)))


_QMM_REDUCE_NORM = KernelSpec("lathe_qmm_reduce_residual_norm", "gemv/qmm_reduce.metal",
                              ("part", "dims", "residual", "gamma", "eps"), ("y", "h"),
                              prelude="#define LATHE_RESIDUAL 1\n#define LATHE_GATED 0\n#define LATHE_ACT 0\n"
                                      "#define LATHE_NORM_OUT 1",
                              threadgroup_bytes=lambda c: 4 * c["NSIMD"])


def qmm_splits(k: int, ks: int) -> tuple[int, int]:
    """(KS, KSPL): K in KS parts of KSPL values, whole super-chunks of 128 (the last part shorter),
    none of them empty: at most ks parts."""
    if ks < 1:
        raise ValueError(f"ks must be at least 1, got {ks}")
    supers = -(-k // 128)
    kspl = 128 * -(-supers // min(ks, supers))
    return -(-k // kspl), kspl


def qmm_by_shape(m: int, n: int, k: int, qtype: str) -> dict[str, int]:
    """qmm's knobs for M rows of a `qtype` [N, K] matrix: 8 * NB * WN rows of W a threadgroup, WK
    SIMD groups along K in it, PF the weights loaded a super-chunk ahead, XS X's staged buffers (0:
    unstaged), WR W through a ring on X's rounds, SPLIT whether K is split (qmm_parts).

    - K from 4096 (the 8B's): NB 4, WN 2, WK 2, split. The sweep of a397c5c (H100, each call
      alone, 16 and 64 rows) put it first by geometric mean at both row counts: 10.0 us for 16
      rows of the 4096 x 4096 Q4_0 (20.5 at a97bf5f, X staged, in the machine session before).
      End to end, in one session, the 8B's 16- and 64-token prompts went from 1.27-1.35x and
      0.72-0.74x llama-bench (a397c5c) to 1.38-1.46x and 0.97-1.03x (8db493e).
    - Shorter K (Qwen3-0.6B's 1024-3072): 10cb374's knobs, no split. With the 8B's knobs its
      16-token prompt fell from 1.16-1.18x llama-bench (a397c5c) to 0.76-1.08x (8db493e), and to
      0.84-0.90x unsplit (1885abc); its 64-token prompt rose (0.99-1.02x to 1.17-1.39x). K split
      (qmm_fill's parts) from K = 2048 with those knobs: the sweep of d1c7394 (H200, Q8_0) took
      Qwen3's 1024-row O and down from 8.4 and 11.3 us to 6.1-6.3 and 7.1 at 32 rows, from 13.7
      and 19.4 to 8.2 and 10.3 at 64; its 4096 and 6144 x 1024 matrices are fastest unsplit.
    - X staged in 2 buffers for the threadgroup (XS), 4 SIMD groups across N (NB 4) where N >= K,
      8 (NB 2) where K is the longer, on the 8B's two largest matrices (N * K from 4096 * 14336:
      gate+up, down, the head) past 32 rows (a5c36c6, d4bb708: 64 sequences 3-8% faster end to end).
      Q4_0 and Q8_0 (whose weights can be fetched ahead) stage more: past 32 rows on every matrix
      of K from 4096, with PF 1; from 17 to 32 rows on the largest, with W's ring (WR 1). The sweep of
      d1c7394 (H200, GPU time, each call alone), Q4_0, us against the unstaged rule: 64 rows 74.4
      against 92.9 staged without PF (28672 x 4096), 49.7 against 57.1 (4096 x 14336), 25.3 against
      31.8 (6144 x 4096), 19.0 against 19.4 (4096 x 4096), 290 against 359 (128256 x 4096); 32 rows
      with the ring 50.0 against 64.2, 32.8 against 43.7, 184 against 224; 32 rows of the smaller
      two and 16 rows of any stay unstaged (level or slower staged; kernels/gemv/NOTES.md).
    - Option qmm_x_staged: auto (the above), 0 (never staged), n (2..4: staged on every shape,
      n buffers, lowered to what fits the backend's threadgroup memory, without PF or the ring).
      Where 2 buffers do not fit (Metal's 32 KiB at 64 rows), the unstaged rule."""
    code, budget = block_format(qtype)[0], backends.threadgroup_memory()
    staged, ahead = options.get("qmm_x_staged"), code <= 1  # Q4_0, Q8_0: pf and wr apply
    (nb, wn), mp, pf, wr = ((4, 4) if n >= k else (2, 8)), -(-m // 16) * 16, 0, 0
    if staged == "auto":
        largest = n * k >= 4096 * 14336
        # W's ring beside 2 buffers of X, the prologue's sums with them (Q8_0's ring, twice Q4_0's,
        # does not fit 48 KiB at 32 rows: those launches keep the unstaged rule)
        ring = ahead and m <= 32 and qmm_smem_bytes(mp, nb, wn, 1, True, 2, qmm_ring_words(code, 1)) <= budget
        staged = 2 if (m > 32 and (largest or (ahead and k >= 4096))) or (m > 16 and largest and ring) else 0
        # pf only from K = 4096, as swept: Qwen3's head (151936 x 1024) keeps d1c7394's staged X alone
        pf, wr = int(ahead and m > 32 and k >= 4096), int(ring)
    while staged > 2 and qmm_smem_bytes(mp, nb, wn, 1, True, staged) > budget:
        staged -= 1
    # staged X past the budget (Metal's 32 KiB at 64 rows): the unstaged rule
    if staged and qmm_smem_bytes(mp, nb, wn, 1, True, staged) <= budget:
        return dict(NB=nb, WN=wn, WK=1, PF=pf, XS=staged, WR=wr, SPLIT=int(k >= 4096))
    if k < 4096:  # split where K holds 16 super-chunks or more (Qwen3's O and down, 1024 rows)
        return dict(NB=2, WN=2, WK=4, PF=0, XS=0, WR=0, SPLIT=int(k >= 2048))
    return dict(NB=4, WN=2, WK=2, PF=0, XS=0, WR=0, SPLIT=1)


def qmm_parts(groups: int, m: int = 16, simd_groups: int = 4, ahead: bool = False) -> int:
    """The parts K is split into for a launch of `groups` row blocks of M rows (the qmm_fill
    option): enough threadgroups for qmm_fill (half of it past 32 rows, whose threadgroups each
    take four times the products, or where W is fetched ahead (`ahead`: pf or wr), whose
    threadgroups keep more loads in flight), at most 8 parts (4 where ahead); 1 (no split) where
    qmm_fill is 0. qmm_fill counts threadgroups of the rule's 4 SIMD groups: one of 8 (the staged
    geometry's 2 x 8) counts twice, as it keeps twice the warps busy. The sweep of d1c7394 (1, 2
    and 4 parts where W is fetched ahead): 32 rows of 28672 x 4096 with W's ring unsplit 50.0 us,
    2 parts 55.4; 64 rows with PF 1 of 4096 x 4096 and 6144 x 4096 fastest in 4 parts."""
    fill = options.get("qmm_fill")
    if m > 32 or ahead:
        fill //= 2
    groups = max(1, groups * simd_groups // 4)
    return max(1, min(4 if ahead else 8, fill // groups)) if fill else 1


def qmm_split_k(k: int, groups: int, m: int, simd_groups: int, ahead: bool, split: bool,
                ks: int | None = None) -> tuple[int, int]:
    """(KS, KSPL) of a qmm launch of `groups` row blocks: `ks` parts where given, else qmm_parts'
    where the rule splits K (`split`; `ahead`: the launch fetches W ahead, pf or wr), else one."""
    return qmm_splits(k, ks if ks is not None else qmm_parts(groups, m, simd_groups, ahead) if split else 1)


@_per_budget
def qmm_geometry(m: int, n: int, k: int, nb: int, wn: int, wk: int, *, norm: bool = False, xs: int = 0,
                 w_ring: int = 0, wr: int = 1, budget: int) -> tuple[int, int, int, int]:
    """(MP, NB, WN, WK) of a qmm launch: M rounded up to 16 and the knobs, whose partial sums (and
    xs buffers of staged X, W's ring of `w_ring` words a chunk, wr ahead without xs) must fit the
    threadgroup memory budget."""
    if 32 * wn * wk > 1024:
        raise ValueError(f"WN * WK = {wn * wk} SIMD groups: a threadgroup takes at most 32")
    mp = -(-m // 16) * 16
    if qmm_smem_bytes(mp, nb, wn, wk, norm, xs, w_ring, wr) > budget:
        raise ValueError(f"qmm: M={m} with NB={nb}, WN={wn}, WK={wk}" + (f", XS={xs}" if xs else "") +
                         (f", WR={wr}" if w_ring else "") + f" does not fit {budget} bytes of threadgroup memory")
    return mp, nb, wn, wk


# qmm_combine auto: a split launch adds its own parts up to this many rows of X. On the H200 at
# 77f24ad (serve beside llama-batched-bench, two rounds) the in-launch adds took the 8B's steps of 8
# sequences from 1.52-1.55x to 1.61-1.62x and Qwen3's (host-bound) from 0.79-0.84x to 0.98-1.20x,
# left 32 level, and cost the 8B's 64 8% (1.63-1.66x against 1.76-1.84x): each row block's last
# threadgroup then adds 64 rows of its columns alone, where the adding launch spreads them over the GPU.
QMM_LAST_UP_TO = 16


def qmm_last_group(m: int) -> bool:
    """Whether a split qmm launch of M rows (given its site's counters) adds its own parts: the
    qmm_combine option."""
    combine = options.get("qmm_combine")
    return combine == "last_group" or (combine == "auto" and m <= QMM_LAST_UP_TO)


def qmm_counters(n: int) -> mx.array:
    """Counters for one qmm launch site's in-launch adds (`counters=`, the qmm_combine option's
    last_group): zero, on the device, one for each row block a launch of N rows of W can have. A
    launch leaves them zero. Two launches on the same counters must be ordered (data between them,
    as a decode step's projections have, or an eval): MLX's CUDA graph runs launches with nothing
    between them side by side, and their counts would mix."""
    return resident(mx.zeros((n // 8 + 1,), mx.uint32))


def qmm(x: mx.array, w: Packed | RowBlocks, qtype: str, n: int, k: int, *, residual: mx.array | None = None,
        gamma: mx.array | None = None, eps: float | None = None, activation: str | None = None,
        next_norm: tuple[mx.array, float] | None = None, counters: mx.array | None = None,
        **knobs: int | None) -> mx.array | tuple[mx.array, mx.array]:
    """Y[M, N] = X[M, K] @ W^T (+ residual, fp16 [M, N]) for M up to QMM_MAX_M, W repacked (any v3
    block type; Q4_0 and Q8_0 also as RowBlocks), on SIMD-group matrices (qmm.metal). `gamma`
    (fp16 [K]) and `eps`: X RMS-normed first (RMSNorm(X) * gamma), in the same launch.
    `activation` ("silu", "gelu"): W is a fused [gate; up] matrix (N = 2F rows) and Y =
    act(X @ gate^T) * (X @ up^T), [M, F]. Launch knobs: nb, wn, wk, ks, pf, xs, wr (qmm_by_shape's
    where not given, pf, xs and wr 0 where nb, wn or wk is; gated, an even nb); ks > 1 splits K
    over ks threadgroups a row block, whose float32 sums a second launch adds (qmm_reduce.metal);
    pf 1 loads the next super-chunk's weights (Q4_0, Q8_0) before this one's products; xs 2..4
    stages X in that many threadgroup buffers for all the threadgroup's SIMD groups (0: each lane
    loads its own from device memory); wst 1 loads Q4_0's and Q8_0's weights evict-first
    (load_stream); wr (not with pf) brings Q4_0's and Q8_0's weights through a ring in threadgroup
    memory: with xs, wr 1, on X's rounds, xs - 1 super-chunks ahead; without, wr 1..4 super-chunks
    ahead (a sweep knob: no rule launches it), each lane waiting for its own copies.

    `next_norm` (gamma fp16 [N], eps; with the residual, not gated, N a multiple of 8): Y is the
    residual stream and qmm returns (Y, H), H = RMSNorm(Y) * gamma, written by the launch that adds
    the parts (K in one part where unsplit): the next block's norm without a launch of its own. H is
    kernels.loop.rmsnorm's bit for bit up to N = 1024 (its threadgroup's layout), within an fp16
    step past it (more SIMD groups a row: qmm_reduce_nsimd).

    `counters` (the site's qmm_counters; not with next_norm, whose rows need every part of every
    row block): a split launch adds its parts itself, in the last threadgroup of each row block,
    where the qmm_combine option says so (qmm_last_group); the sums, their order and Y are the
    adding launch's."""
    rows8 = isinstance(w, RowBlocks)  # the layout of interleave_rows (ROWS8)
    given = w
    if rows8:
        if qtype not in ("q4_0", "q8_0") or n % 8 or k % 128:
            raise ValueError(f"RowBlocks are Q4_0 or Q8_0 of whole row blocks and super-chunks, got {qtype} N={n} K={k}")
        _check_packed(w, qtype, n, k)
        w = Packed(w.data, w.qtype, w.n, w.k)  # the same bytes: Packed's checks hold
    check_gemv_args(x, w, qtype, n, k, max_m=QMM_MAX_M)
    if not isinstance(w, Packed):
        raise ValueError("qmm takes weights repacked by kernels.gemv.repack (Packed, or RowBlocks), not GGUF blocks")
    m = x.shape[0]
    unknown = set(knobs) - {"nb", "wn", "wk", "ks", "pf", "xs", "wst", "wr"}
    if unknown:
        raise ValueError(f"unknown launch knobs {sorted(unknown)}: nb, wn, wk, ks, pf, xs, wst, wr")
    shaped = qmm_by_shape(m, n, k, qtype)
    if any(knobs.get(key) for key in ("nb", "wn", "wk")):  # the rule's staging and W ahead go with its geometry
        shaped = dict(shaped, PF=0, XS=0, WR=0)
    pf = shaped["PF"] if knobs.get("pf") is None else knobs["pf"]
    if pf not in (0, 1):
        raise ValueError(f"pf (the next super-chunk's weights loaded ahead) must be 0 or 1, got {pf}")
    xs = shaped["XS"] if knobs.get("xs") is None else knobs["xs"]
    if xs not in (0, 2, 3, 4):  # a buffer being filled while one is read: at least 2
        raise ValueError(f"xs (X's staged buffers) must be 0, 2, 3 or 4, got {xs}")
    wst = knobs.get("wst") or 0
    if wst not in (0, 1):
        raise ValueError(f"wst (W's loads evict-first) must be 0 or 1, got {wst}")
    wr = shaped["WR"] if knobs.get("wr") is None else knobs["wr"]
    if wr not in ((0, 1) if xs else (0, 1, 2, 3, 4)):
        raise ValueError(f"wr (W through a ring: with xs, 1, on X's rounds; without, 1..4 super-chunks ahead) "
                         f"must be {'0 or 1 with xs' if xs else '0..4'}, got {wr}")
    if wr and pf:
        raise ValueError(f"wr and pf both fetch W ahead: one of them, got wr {wr}, pf {pf}")
    norm, gated = gamma is not None, activation is not None
    if norm:
        _check_norm(gamma, 0.0 if eps is None else eps, k)
    if gated:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if n % 2 or residual is not None:
            raise ValueError(f"a gated qmm takes [gate; up] (an even N, got {n}) and no residual")
    n_out = n // 2 if gated else n
    if residual is not None:
        _check_residual(residual, m, n_out)
    if next_norm is not None:
        _check_next_norm(next_norm, residual, activation, n)
    if all(v is None for v in knobs.values()) and qmm_on_mma(qtype, n, k, norm, activation, next_norm) \
            and not (rows8 and gated and n % 16):
        return qmm_mma(x, given, qtype, n, k, residual=residual, activation=activation, next_norm=next_norm)
    # the rule's knobs passed as they are: qmm_geometry is cached by its arguments, the rule reads
    # an option (qmm_x_staged)
    mp, nb, wn, wk = qmm_geometry(m, n_out if gated else n, k, knobs.get("nb") or shaped["NB"],
                                  knobs.get("wn") or shaped["WN"], knobs.get("wk") or shaped["WK"], norm=norm, xs=xs,
                                  w_ring=qmm_ring_words(block_format(qtype)[0], wr), wr=wr)
    if gated and nb % 2:
        raise ValueError(f"a gated qmm takes gate and up row blocks in pairs: nb must be even, got {nb}")
    groups = -(-n_out // (8 * (nb // 2 if gated else nb) * wn))
    ks, kspl = qmm_split_k(k, groups, m, wn * wk, bool(pf or wr), bool(shaped["SPLIT"]), knobs.get("ks"))
    inputs = [x, w.data, _dims(n, k), *((gamma, _eps(float(eps))) if norm else ())]
    constants = dict(QTYPE=block_format(qtype)[0], M=m, MP=mp, NB=nb, WN=wn, WK=wk, PF=pf, XS=xs, WST=wst, WR=wr,
                     ROWS8=int(rows8), K=k)
    if ks == 1 and next_norm is None:
        (y,) = launch(Launch(_QMM[residual is not None, norm, activation],
                             [*inputs, *(() if residual is None else (residual,))], [((m, n_out), mx.float16)],
                             (groups * 32 * wn * wk, 1, 1), (32 * wn * wk, 1, 1), constants))
        return y
    split = dict(constants, KS=ks, KSPL=kspl)
    if counters is not None and next_norm is None and qmm_last_group(m):
        if counters.dtype != mx.uint32 or counters.ndim != 1 or counters.size < groups:
            raise ValueError(f"counters must be uint32 [>= {groups}] (qmm_counters), got {counters.dtype} "
                             f"{list(counters.shape)}")
        _, y = launch(Launch(_QMM_LAST[residual is not None, norm, activation],
                             [*inputs, counters, *(() if residual is None else (residual,))],
                             [((ks, m, n), mx.float32), ((m, n_out), mx.float16)],
                             (groups * 32 * wn * wk, ks, 1), (32 * wn * wk, 1, 1), split))
        return y
    (part,) = launch(Launch(_QMM_SPLIT[norm, gated], inputs, [((ks, m, n), mx.float32)],
                            (groups * 32 * wn * wk, ks, 1), (32 * wn * wk, 1, 1), split))
    return _qmm_add_parts(part, m, n, k, ks, residual, activation, next_norm)


def _qmm_add_parts(part: mx.array, m: int, n: int, k: int, ks: int, residual: mx.array | None,
                   activation: str | None,
                   next_norm: tuple[mx.array, float] | None) -> mx.array | tuple[mx.array, mx.array]:
    """The launch that adds qmm's (or qmm_mma's) float32 parts [KS, M, N] (qmm_reduce.metal) and
    applies the epilogue: the residual, act(gate) * up, or with next_norm (Y, RMSNorm(Y) * gamma)."""
    if next_norm is not None:
        nsimd = qmm_reduce_nsimd(n)
        return tuple(launch(Launch(_QMM_REDUCE_NORM, [part, _dims(n, k), residual, next_norm[0],
                                                      _eps(float(next_norm[1]))], [((m, n), mx.float16)] * 2,
                                   (m * 32 * nsimd, 1, 1), (32 * nsimd, 1, 1), dict(M=m, KS=ks, NSIMD=nsimd))))
    n_out = n // 2 if activation is not None else n
    (y,) = launch(Launch(_QMM_REDUCE[residual is not None, activation],
                         [part, _dims(n, k), *(() if residual is None else (residual,))], [((m, n_out), mx.float16)],
                         (-(-m * n_out // 256) * 256, 1, 1), (256, 1, 1), dict(M=m, KS=ks)))
    return y


# ---- the quantized GEMM on the warp MMA (a native CUDA variant of qmm) -----------------------------
QMM_MMA = "gemv/qmm_mma.cu"
QMM_MMA_QTYPES = ("q4_0", "q8_0")
QMM_MMA_SMEM = 227 * 1024  # a CTA's shared memory on sm_90
QMM_MMA_SM_SMEM = 228 * 1024  # an SM's, for the CTAs it keeps resident
QMM_MMA_SMS = 132  # the SMs a launch is sized by where the driver does not say (the H100's and H200's)
QMM_MMA_SG_MAX = 2  # the most groups a stage the rule gives (qmm_mma_geometry)
# qmm_mma under the option's auto: matrices of this many weights and more (the 8B's, from 4096 x 4096).
# On Qwen3-0.6B's (1024 x 2048, 1024 x 3072) serve's fused steps of 8 sequences were 35% slower
# with it: host-bound, and qmm_mma adds its parts in a launch of its own where qmm's last
# threadgroup adds them (kernels/gemv/NOTES.md)
QMM_MMA_AUTO_WEIGHTS = 1 << 24


def qmm_mma_refuses(qtype: str, k: int) -> str:
    """Why qmm_mma.cu's shapes cannot take this product ('' where they can): Q4_0 or Q8_0, K whole
    groups of 128 (X's rows: check_gemv_args; the GPU: kernels.native.unavailable_reason)."""
    if qtype not in QMM_MMA_QTYPES:
        return f"{qtype} (it takes {', '.join(QMM_MMA_QTYPES)})"
    if k % 128:
        return f"K={k} (it takes whole groups of 128 values)"
    return ""


def qmm_mma_smem(m: int, qtype: str, tm: int, nw: int, stages: int, sg: int, kw: int = 1) -> int:
    """Shared memory of a qmm_mma launch (qmm_mma.cu's SMEM_BYTES): a ring of `stages` slots, each
    X's M rows of sg kw groups (72 bytes a block, rows 32 bytes past a 128-byte line) and each warp's
    16 tm rows of W for its sg groups (quants, then scales); or, where more, the sums that K warps
    past the first hand the first at the end."""
    x_pitch = (sg * kw * 4 * 72 + 96) // 128 * 128 + 32
    x_slot = -(-m * x_pitch // 16) * 16
    quant = 16 if qtype == "q4_0" else 32
    w_slot = 16 * tm * (sg * 4 * quant + sg * 8)
    sums = (kw - 1) * (nw // kw) * 32 * tm * -(-m // 8) * 4 * 4
    return max(stages * (x_slot + nw * w_slot), sums)


def qmm_mma_constants(qtype: str, m: int, n: int, k: int, geo: dict[str, int], gated: bool,
                      residual: bool, rows8: bool = False) -> dict[str, int]:
    """qmm_mma.cu's compile-time constants for a launch of these knobs (qmm_mma_geometry's form;
    kw 1 where absent): the residual is the kernel's only where K is one part; `rows8`: W as RowBlocks."""
    return dict(QT=QMM_MMA_QTYPES.index(qtype), ROWS8=int(rows8), M=m, N=n, K=k, TM=geo["tm"], NW=geo["nw"],
                KW=geo.get("kw", 1), KS=geo["ks"], SG=geo["sg"], STAGES=geo["stages"], PF=geo["pf"], GATED=int(gated),
                RESID=int(residual and geo["ks"] == 1), SK=geo.get("sk", 0))


def qmm_mma_geometry(m: int, n: int, k: int, qtype: str, gated: bool, parts: int = 1) -> dict[str, int]:
    """The launch knobs (tm, nw, kw, ks, stages, sg, pf), from the sweeps of df27d24 (8 and 16 rows) and
    4d09f63 (16 rows, Q4_0; kernels/gemv/NOTES.md, "qmm on the warp MMA"): 3 slots of 2 groups (fewer
    where X's rows do not leave room); 4 warps a CTA (Q4_0 past 32 rows 8, as measured at 64); two
    16-row tiles a warp on the widest or deepest matrices (and gated: a gate and an up tile), else
    one; W's L2 prefetch off (slower in every swept case); and the fewest parts of K (each a stage at least)
    that give the SMs (runtime.sm_count, QMM_MMA_SMS where the driver does not say) half the CTAs
    their shared memory lets them keep, or more. On matrices under QMM_MMA_AUTO_WEIGHTS at up to 16
    rows, where that splits K and one part will do (`parts` 1; next_norm's launches take 2), 4 K warps
    a CTA of one row warp take K in its place: one launch, not the parts' adding one (Qwen3-0.6B's
    four matrices at 8 rows: 1.3-1.5x the split's GPU time; kernels/gemv/NOTES.md)."""
    from kernels import runtime

    rows = n // 2 if gated else n
    tm, nw = (2 if gated or rows >= 16384 or k >= 8192 else 1), (8 if qtype == "q4_0" and m > 32 else 4)
    stages, sg = next(((st, g) for st, g in ((3, 2), (2, 2), (2, 1))
                       if qmm_mma_smem(m, qtype, tm, nw, st, g) <= QMM_MMA_SMEM), (2, 1))
    resident = max(1, min(QMM_MMA_SM_SMEM // qmm_mma_smem(m, qtype, tm, nw, stages, sg), 2048 // (32 * nw)))
    ctas = -(-rows // (16 * (tm // 2 if gated else tm) * nw))
    ks, stages_k = 1, -(-k // (128 * sg))
    sms = runtime.sm_count() or QMM_MMA_SMS
    while ctas * ks <= sms * resident // 2 and 2 * ks <= stages_k:
        ks *= 2
    if ks > 1 and parts == 1 and m <= 16 and n * k < QMM_MMA_AUTO_WEIGHTS:
        tm = 2 if gated else 1
        stages, sg = next((st, g) for st, g in ((3, 2), (3, 1), (2, 1)) if qmm_mma_smem(m, qtype, tm, 4, st, g, 4)
                          <= QMM_MMA_SMEM)
        return dict(tm=tm, nw=4, kw=4, ks=1, stages=stages, sg=sg, pf=0)
    return dict(tm=tm, nw=nw, kw=1, ks=max(ks, parts), stages=stages, sg=sg, pf=0)


def qmm_mma_launch_knobs(m: int, n: int, k: int, qtype: str, gated: bool, parts: int = 1,
                        knobs: dict[str, int | None] | None = None) -> dict[str, int]:
    """The launch's knobs: qmm_mma_geometry's, those given over them. Knobs given without kw are
    the one-K-warp form's (the rule's K warps do not carry over to a launch set by hand)."""
    given = {key: v for key, v in (knobs or {}).items() if v is not None}
    geo = qmm_mma_geometry(m, n, k, qtype, gated, parts)
    if given and "kw" not in given:
        geo["kw"] = 1
    return dict(geo, **given)


def qmm_on_mma(qtype: str, n: int, k: int, norm: bool, activation: str | None,
               next_norm: tuple[mx.array, float] | None) -> bool:
    """Whether qmm() hands this launch to qmm_mma (the qmm_mma option, where native kernels run):
    Q4_0 or Q8_0 on K whole groups, no RMSNorm prologue, no activation but SiLU's, with next_norm a K
    of two stages at least (its parts go to the adding launch that writes the norm); under auto, a
    matrix of QMM_MMA_AUTO_WEIGHTS weights or more."""
    setting = options.get("qmm_mma")
    if not setting or (setting == "auto" and n * k < QMM_MMA_AUTO_WEIGHTS) or qtype not in QMM_MMA_QTYPES \
            or qmm_mma_refuses(qtype, k) or norm or activation not in (None, "silu") \
            or (next_norm is not None and k < 2 * 128 * QMM_MMA_SG_MAX):
        return False
    from kernels import native

    return native.available()


def qmm_mma_tiles(n_out: int, tm: int, nw: int, kw: int, gated: bool) -> int:
    """A qmm_mma launch's CTA tiles (qmm_mma.cu's TILES): Y's columns over a CTA's."""
    return -(-n_out // (16 * (tm // 2 if gated else tm) * (nw // kw)))


def qmm_mma(x: mx.array, w: Packed | RowBlocks, qtype: str, n: int, k: int, *, residual: mx.array | None = None,
            activation: str | None = None, next_norm: tuple[mx.array, float] | None = None,
            counters: mx.array | None = None, **knobs: int) -> mx.array | tuple[mx.array, mx.array]:
    """qmm on the warp MMA (qmm_mma.cu, a native CUDA kernel: sm_90a): Y[M, N] = X[M, K] @ W^T
    (+ residual), W Q4_0 or Q8_0 repacked (Packed, read in place; or RowBlocks, whose stages are runs of
    a row block's 8 rows), M 1..64, K a multiple of 128.
    `activation` "silu": W is [gate; up] (N = 2F rows), Y = silu(X @ gate^T) * (X @ up^T), [M, F].
    Launch knobs (qmm_mma_launch_knobs's where not given): tm 16-row tiles a warp, nw warps a CTA, kw
    of them K warps (each a share of a stage's groups, their sums added in the CTA), ks parts of K
    (past 1 a second launch, qmm_reduce.metal's, adds them and applies the epilogue), stages slots
    of the ring of X and W, sg groups of K (128 values) a warp a slot, pf 0 or the stages of each W
    row asked of the L2 in one run (prefetch.global.L2), pf stages ahead of the ring.
    `next_norm` (gamma, eps; with the residual, not gated) as qmm's: K in two parts at least, whose
    adding launch (qmm_reduce.metal's) also writes H = RMSNorm(Y) * gamma; returns (Y, H).
    Knob sk (stream-K, a sweep knob: no rule sets it): sk CTAs, each an equal run of the (CTA tile,
    stage) units, the parts of a tile added by the CTA that finishes it last, in one launch (K whole:
    ks 1, no next_norm); on `counters` (uint32, one a CTA tile, zero; left zero, so one array serves
    launches one after another), made for the call where not given."""
    rows8 = isinstance(w, RowBlocks)
    check_gemv_args(x, Packed(w.data, w.qtype, w.n, w.k) if rows8 else w, qtype, n, k, max_m=QMM_MAX_M)
    if not isinstance(w, (Packed, RowBlocks)):
        raise ValueError("qmm_mma takes weights repacked by kernels.gemv.repack (Packed, or RowBlocks), "
                         "not GGUF blocks")
    m = x.shape[0]
    why = qmm_mma_refuses(qtype, k)
    if why:
        raise ValueError(f"qmm_mma cannot take {why}")
    if rows8 and activation is not None and n % 16:
        raise ValueError(f"a gated qmm_mma on RowBlocks takes gate's and up's rows in whole row blocks of 8: N={n}")
    gated = activation is not None
    if gated and (activation != "silu" or n % 2 or residual is not None):
        raise ValueError(f"a gated qmm_mma takes activation 'silu', [gate; up] (an even N, got {n}) and no residual, "
                         f"got activation {activation!r}")
    n_out = n // 2 if gated else n
    if residual is not None:
        _check_residual(residual, m, n_out)
    if next_norm is not None:
        _check_next_norm(next_norm, residual, activation, n)
    unknown = set(knobs) - {"tm", "nw", "kw", "ks", "stages", "sg", "pf", "sk"}
    if unknown:
        raise ValueError(f"unknown launch knobs {sorted(unknown)}: tm, nw, kw, ks, stages, sg, pf, sk")
    # the norm is the adding launch's: parts, however few
    geo = qmm_mma_launch_knobs(m, n, k, qtype, gated, 1 if next_norm is None else 2, knobs)
    tm, nw, kw, ks, stages, sg, pf = (geo[key] for key in ("tm", "nw", "kw", "ks", "stages", "sg", "pf"))
    if next_norm is not None and (ks < 2 or ks > -(-k // (128 * sg * kw))):
        raise ValueError(f"qmm_mma with next_norm splits K in parts (ks >= 2), each a stage of {sg * kw} groups at "
                         f"least: got ks {ks} for K={k}")
    if tm not in (1, 2, 4) or (gated and tm % 2) or nw not in (1, 2, 4, 8, 16) or kw not in (1, 2, 4) or nw % kw \
            or not 1 <= ks <= 64 or stages not in (2, 3, 4) or sg not in (1, 2, 4, 8) \
            or pf not in (0, 1, 2, 4, 8, 16) or (pf and kw > 1):
        raise ValueError(f"qmm_mma's knobs: tm 1, 2 or 4 (gated: even), nw 1..16, kw 1, 2 or 4 dividing nw, "
                         f"ks 1..64, stages 2..4, sg 1, 2, 4 or 8, pf 0, 1, 2, 4, 8 or 16 (0 with kw past 1); got "
                         f"tm {tm}, nw {nw}, kw {kw}, ks {ks}, stages {stages}, sg {sg}, pf {pf}")
    smem = qmm_mma_smem(m, qtype, tm, nw, stages, sg, kw)
    if smem > QMM_MMA_SMEM:
        raise ValueError(f"qmm_mma's ring needs {smem} bytes of shared memory, past {QMM_MMA_SMEM}: fewer warps, "
                         f"tiles, slots or groups a slot")
    from kernels import native

    ctas = qmm_mma_tiles(n_out, tm, nw, kw, gated)
    sk = geo.get("sk", 0)
    if sk:
        units = ctas * -(-k // (128 * sg * kw))
        if ks != 1 or next_norm is not None or not 1 <= sk <= units:
            raise ValueError(f"qmm_mma's stream-K (sk) takes K whole (ks 1, no next_norm) and 1..{units} CTAs (the "
                             f"launch's tile stages), got sk {sk}, ks {ks}")
        if counters is None:
            counters = mx.zeros((ctas,), mx.uint32)
        elif counters.dtype != mx.uint32 or counters.ndim != 1 or counters.size < ctas:
            raise ValueError(f"qmm_mma's counters are uint32, one a CTA tile ({ctas}), got {counters.dtype} "
                             f"{list(counters.shape)}")
    constants = qmm_mma_constants(qtype, m, n, k, geo, gated, residual is not None, rows8)
    inputs = [x, w.data, residual if residual is not None and ks == 1 else x]
    grid, group = (ctas * 32 * nw, ks, 1), (32 * nw, 1, 1)
    if sk:
        spill = 2 * sk * (nw // kw) * tm * -(-m // 8) * 4 * 32
        y, _ = native.launch(QMM_MMA, "lathe_qmm_mma", constants, inputs + [counters],
                             [((m, n_out), mx.float16), ((spill,), mx.float32)], (sk * 32 * nw, 1, 1), group, smem)
        return y
    if ks == 1:
        (y,) = native.launch(QMM_MMA, "lathe_qmm_mma", constants, inputs, [((m, n_out), mx.float16)], grid, group,
                             smem)
        return y
    (part,) = native.launch(QMM_MMA, "lathe_qmm_mma", constants, inputs, [((ks, m, n), mx.float32)], grid, group,
                            smem)
    return _qmm_add_parts(part, m, n, k, ks, residual, activation, next_norm)


# ---- a probe: how the memory system serves W's loads in a GEMM's order ----------------------------------
_W_ORDER_PROBE = KernelSpec("lathe_w_order_probe", "gemv/w_order_probe.metal", ("w",), ("out",),
                            threadgroup_bytes=lambda c: (c["DEPTH"] + 1) * c["NB"] * 128 * 16)
W_ORDERS = {"qmm": 0, "rows": 1, "interleaved": 2}  # w_order_probe.metal's ORDER


def w_order_probe_warps(n: int, nb: int, groups: int) -> int:
    """The SIMD groups a w_order_probe launch takes: GROUPS threadgroups of 4, or one block group each."""
    return 4 * (groups or -(-(n // (8 * nb)) // 4))


def w_order_probe(w: mx.array, n: int, chunks_k: int, *, order: str, nb: int = 4, depth: int = 1,
                  groups: int = 0) -> mx.array:
    """Read `w` (uint32 [n * chunks_k * 4]: N rows of chunks_k 16-byte words, the repacked Q4_0
    quants' shape) once in a GEMM's load order and XOR it, a uint32 a lane (w_order_probe.metal):
    `order` "qmm" (qmm's fragments: 8 rows x 64 bytes an instruction), "rows" (the v3 GEMV's: 512
    bytes of one row) or "interleaved" (a block's 8 rows a super-chunk at a time: 512 bytes, one
    run); `nb` blocks of 8 rows a SIMD group, `depth` super-chunks of them in flight a lane (cp.async
    into threadgroup memory, (depth + 1) * nb * 2 KiB a threadgroup, within the backend's budget),
    `groups` threadgroups of 4 SIMD groups striding over the blocks (0: one
    each). A measurement of the loads alone; the XOR of the output is the XOR of w."""
    if order not in W_ORDERS:
        raise ValueError(f"order must be one of {sorted(W_ORDERS)}, got {order!r}")
    if w.dtype != mx.uint32 or w.ndim != 1 or w.size != n * chunks_k * 4:
        raise ValueError(f"w must be uint32 [{n * chunks_k * 4}] ({n} rows of {chunks_k} 16-byte words), "
                         f"got {w.dtype} {list(w.shape)}")
    if nb not in (1, 2, 4, 8) or n % (8 * nb) or chunks_k % 32:
        raise ValueError(f"the probe takes nb 1, 2, 4 or 8, N a multiple of 8 * nb and whole runs of 32 words a "
                         f"row, got nb {nb}, N {n}, {chunks_k} words a row")
    if depth not in (1, 2, 4) or (depth + 1) * nb > 24 or groups < 0:
        raise ValueError(f"depth must be 1, 2 or 4, its ring of (depth + 1) * nb * 2 KiB within 48 KiB, groups >= 0; "
                         f"got depth {depth}, nb {nb}, groups {groups}")
    warps = w_order_probe_warps(n, nb, groups)
    (out,) = launch(Launch(_W_ORDER_PROBE, [w], [((warps * 32,), mx.uint32)], (warps * 32, 1, 1), (128, 1, 1),
                           dict(ORDER=W_ORDERS[order], NB=nb, DEPTH=depth, GROUPS=groups, N=n, CHUNKS_K=chunks_k)))
    return out


# ---- any M, fused projections -----------------------------------------------------------------------
def qmm_takes(m: int) -> bool:
    """Whether linear() gives M rows of X on repacked weights to qmm: MAX_M + 1..QMM_UP_TO rows,
    with the prompt_qmm option on (the GEMV below, GEMV launches or dequantize + matmul above)."""
    return MAX_M < m <= QMM_UP_TO and bool(options.get("prompt_qmm"))


def linear(x: mx.array, w: mx.array | Packed, qtype: str, n: int, k: int, *,
           residual: mx.array | None = None, counters: mx.array | None = None) -> mx.array:
    """Y = X @ W^T (+ residual, [M, N] fp16) for any M (W GGUF blocks, or Packed): the v2 (v3) GEMV for up to MAX_M rows of X;
    on repacked W the quantized GEMM (qmm) up to QMM_UP_TO rows (the prompt_qmm option); else GEMV
    launches of MAX_M rows below BATCHED_FROM, and from there W dequantized to fp16 once and MLX's
    matmul (the prefill path; the crossover was measured: results/<device>/gemv-batched.png), the
    residual added in the same op (mx.addmm: one rounding, one launch fewer than a matmul and an add).
    `counters`: the site's, for qmm's in-launch adds (qmm)."""
    if isinstance(w, RowBlocks):  # only qmm reads them (and checks them)
        m = x.shape[0] if isinstance(x, mx.array) and x.ndim == 2 else 0
        if not qmm_takes(m):
            raise ValueError(f"RowBlocks go to qmm only: {MAX_M + 1}..{QMM_UP_TO} rows of X with prompt_qmm on, "
                             f"got {m} rows (the GEMVs and dequantize take Packed)")
        return qmm(x, w, qtype, n, k, residual=residual, counters=counters)
    check_gemv_args(x, w, qtype, n, k, max_m=None)
    m = x.shape[0]
    if residual is not None and (residual.shape != (m, n) or residual.dtype != mx.float16):
        raise ValueError(f"residual must be float16 [{m}, {n}], got {residual.dtype} {list(residual.shape)}")
    if m <= MAX_M:
        return gemv(x, w, qtype, n, k, residual=residual)
    if isinstance(w, Packed) and qmm_takes(m):
        return qmm(x, w, qtype, n, k, residual=residual, counters=counters)
    if m >= BATCHED_FROM:
        return matmul(x, dequantize(w, qtype, n, k), residual)
    y = mx.concatenate([gemv(x[i:i + MAX_M], w, qtype, n, k) for i in range(0, m, MAX_M)])
    return y if residual is None else y + residual


def matmul(x: mx.array, w16: mx.array, residual: mx.array | None = None) -> mx.array:
    """X @ W^T for fp16 W [N, K] by MLX's matmul, with the residual in the same op where given."""
    return x @ w16.T if residual is None else mx.addmm(residual, x, w16.T)


def concat_rows(weights: Sequence[mx.array]) -> mx.array:
    """One block matrix from several of the same K (rows one after the other): Q, K and V
    projections as one QKV matrix, gate and up as one gate+up matrix."""
    return mx.concatenate([w.reshape(w.shape[0], -1) for w in weights], axis=0)


def split(y: mx.array, sizes: Sequence[int]) -> list[mx.array]:
    """The outputs of a fused projection, cut back into its parts (column counts `sizes`)."""
    if sum(sizes) != y.shape[-1]:
        raise ValueError(f"sizes {tuple(sizes)} do not add up to {y.shape[-1]}")
    cuts = [sum(sizes[:i]) for i in range(1, len(sizes))]
    return mx.split(y, cuts, axis=-1)


options.on_change("gemv_tuning", lambda text: set_tuning(text, from_defaults=True))
