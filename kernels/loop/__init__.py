"""The small kernels of the decode loop: RMSNorm (and residual add + RMSNorm, fused), SwiGLU of a
fused gate+up output, argmax over the vocabulary (the next token id, on the device), and the
embedding lookup from F16, Q8_0, Q4_0 and K-quant (Q4_K, Q5_K, Q6_K) tables. fp16 activations, fp32 math."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from kernels.gemv import V3_QTYPES, block_format
from kernels.runtime import KernelSpec, Launch, constant, index, launch, table_constant

NSIMD = 4
# table type -> (QTYPE of loop/embed.metal, weights a block, bytes a block): the GEMVs' formats
# with their codes (embed.metal decodes them as dequantize.metal does), and F16 (values)
EMBED_TYPES = {**{q: block_format(q) for q in V3_QTYPES}, "f16": (5, 1, 1)}

_RMSNORM = {
    False: KernelSpec("lathe_rmsnorm", "loop/rmsnorm.metal", ("x", "gamma", "dims", "eps"), ("y",),
                      prelude="#define LATHE_RESIDUAL 0\n#define LATHE_X32 0", threadgroup_bytes=lambda c: 4 * c["NSIMD"]),
    True: KernelSpec("lathe_residual_rmsnorm", "loop/rmsnorm.metal",
                     ("x", "residual", "gamma", "dims", "eps"), ("y", "sum"),
                     prelude="#define LATHE_RESIDUAL 1\n#define LATHE_X32 0", threadgroup_bytes=lambda c: 4 * c["NSIMD"]),
    # a float32 x (a residual stream past fp16's range: Gemma's), the normalized rows fp16
    "x32": KernelSpec("lathe_rmsnorm_x32", "loop/rmsnorm.metal", ("x", "gamma", "dims", "eps"), ("y",),
                      prelude="#define LATHE_RESIDUAL 0\n#define LATHE_X32 1", threadgroup_bytes=lambda c: 4 * c["NSIMD"]),
    # a block's fp16 output normalized and added to the float32 stream (post_norm_add)
    "post_add": KernelSpec("lathe_post_norm_add", "loop/rmsnorm.metal", ("x", "stream", "gamma", "dims", "eps"),
                           ("y",), prelude="#define LATHE_RESIDUAL 0\n#define LATHE_X32 0\n#define LATHE_POST_ADD 1",
                           threadgroup_bytes=lambda c: 4 * c["NSIMD"]),
}
ACTIVATIONS = {"silu": 0, "gelu": 1}  # the gated FFN's (lathe.h's gate_act)
_SWIGLU = {act: KernelSpec("lathe_swiglu" + ("" if act == "silu" else f"_{act}"), "loop/swiglu.metal", ("gu", "dims"),
                           ("y",), prelude=f"#define LATHE_ACT {code}") for act, code in ACTIVATIONS.items()}
_ARGMAX = KernelSpec("lathe_argmax", "loop/argmax.metal", ("logits", "dims"), ("token",),
                     threadgroup_bytes=lambda c: 8 * c["NSIMD"])  # a SIMD group's best value and index
_EMBED = KernelSpec("lathe_embed", "loop/embed.metal", ("table", "tokens", "dims"), ("out",))


def _ints(values: tuple[int, ...]) -> mx.array:
    return constant(values)


def _eps(eps: float) -> mx.array:
    return constant((eps,), mx.float32)


def _fp16_2d(name: str, a: mx.array, multiple: int = 8, wide: bool = False) -> tuple[int, int]:
    """[M, K] fp16 (or float32 where `wide`), K a multiple of `multiple`: its shape."""
    if not isinstance(a, mx.array) or a.dtype not in ((mx.float16, mx.float32) if wide else (mx.float16,)):
        raise ValueError(f"{name} must be float16{' or float32' if wide else ''}, got {getattr(a, 'dtype', type(a))}")
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1 or a.shape[1] % multiple:
        raise ValueError(f"{name} must be [M, K] with K a multiple of {multiple}, got {tuple(a.shape)}")
    return a.shape


def _check_gamma(gamma: mx.array, k: int) -> None:
    if not isinstance(gamma, mx.array) or gamma.dtype != mx.float16 or gamma.shape != (k,):
        raise ValueError(f"gamma must be float16 [K={k}], got {getattr(gamma, 'dtype', None)} "
                         f"{tuple(getattr(gamma, 'shape', ()))}")


def rmsnorm(x: mx.array, gamma: mx.array, eps: float, residual: mx.array | None = None):
    """RMSNorm(x) * gamma over the last axis; with `residual`, of x + residual, returned as
    (normalized, x + residual) from one launch. x may be float32 without a residual (a residual
    stream past fp16's range: Gemma's); the normalized rows are fp16."""
    wide = isinstance(x, mx.array) and x.dtype == mx.float32 and residual is None
    m, k = _fp16_2d("x", x, wide=residual is None)
    _check_gamma(gamma, k)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    fused = residual is not None
    if fused and (_fp16_2d("residual", residual) != (m, k)):
        raise ValueError(f"residual must be [{m}, {k}] like x, got {tuple(residual.shape)}")
    inputs = [x] + ([residual] if fused else []) + [gamma, _ints((m, k)), _eps(float(eps))]
    outs = launch(Launch(_RMSNORM["x32" if wide else fused], inputs, [((m, k), mx.float16)] * (2 if fused else 1),
                         (m * 32 * NSIMD, 1, 1), (32 * NSIMD, 1, 1), dict(NSIMD=NSIMD)))
    return (outs[0], outs[1]) if fused else outs[0]


def post_norm_add(x: mx.array, gamma: mx.array, eps: float, stream: mx.array) -> mx.array:
    """stream + RMSNorm(x) * gamma in one launch: a block's fp16 output x [M, K] normalized (Gemma's
    post-attention and post-FFN norms) and added to the float32 residual stream [M, K]; float32."""
    m, k = _fp16_2d("x", x)
    _check_gamma(gamma, k)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if not isinstance(stream, mx.array) or stream.dtype != mx.float32 or tuple(stream.shape) != (m, k):
        raise ValueError(f"stream must be float32 [{m}, {k}], got {getattr(stream, 'dtype', None)} "
                         f"{tuple(getattr(stream, 'shape', ()))}")
    (y,) = launch(Launch(_RMSNORM["post_add"], [x, stream, gamma, _ints((m, k)), _eps(float(eps))],
                         [((m, k), mx.float32)], (m * 32 * NSIMD, 1, 1), (32 * NSIMD, 1, 1), dict(NSIMD=NSIMD)))
    return y


def swiglu(gate_up: mx.array, activation: str = "silu") -> mx.array:
    """act(gate) * up from a fused gate+up output [M, 2F] -> [M, F]: SiLU (SwiGLU), or GELU in
    its tanh approximation (GeGLU: Gemma)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    m, two_f = _fp16_2d("gate_up", gate_up, 16)
    f = two_f // 2
    words = m * f // 8
    (y,) = launch(Launch(_SWIGLU[activation], [gate_up, _ints((m, f))], [((m, f), mx.float16)],
                         (-(-words // 256) * 256, 1, 1), (256, 1, 1), {}))
    return y


ARGMAX_LOADS = 4  # 16-byte loads in flight per thread before any is compared
# argmax's host words: two rows' tokens an 8-byte output, up to this many rows (16 outputs and the
# kernel's 3 buffers, within Metal's 31)
ARGMAX_HOST_ROWS = 32


@functools.cache
def _argmax_host_spec(words: int) -> KernelSpec:
    """argmax.metal with its tokens also in `words` 8-byte outputs of two rows each."""
    cases = " ".join(f"case {i}: host{i}[(ROW) % 2] = (V); break;" for i in range(words))
    return KernelSpec(f"lathe_argmax_host{words}", "loop/argmax.metal", ("logits", "dims"),
                      ("token", *(f"host{i}" for i in range(words))),
                      prelude=f"#define LATHE_HOST_WORDS {words}\n"
                              f"#define LATHE_HOST_WRITE(ROW, V) switch ((ROW) / 2) {{ {cases} }}",
                      threadgroup_bytes=lambda c: 8 * c["NSIMD"])


def tokens_from_words(words: list[mx.array] | tuple[mx.array, ...], m: int) -> list[int]:
    """The M tokens of argmax's host words, read on the host (each word two rows; the last may hold
    one)."""
    return np.concatenate([np.array(w) for w in words])[:m].tolist()


def argmax(logits: mx.array, host_words: bool = False) -> mx.array | tuple[mx.array, tuple[mx.array, ...]]:
    """The first index of the largest value of each row of logits [M, V] (float32, or float16
    as the output head writes them), int32 [M]. A vocabulary-sized row gets 1024 threads.

    `host_words` (M up to ARGMAX_HOST_ROWS): also the tokens as ceil(M / 2) int32 [2] arrays for
    the host to read (tokens_from_words), returned with the tokens: 8-byte outputs, which MLX takes from
    managed memory the GPU maps, so that reading them moves no device buffer to managed memory
    (a read of the int32 [M] tokens would, and a later kernel output reusing that buffer would wait
    for its page: argmax.metal)."""
    if (not isinstance(logits, mx.array) or logits.dtype not in (mx.float32, mx.float16)
            or logits.ndim != 2 or 0 in logits.shape):
        raise ValueError(f"logits must be float32 or float16 [M, V], got {getattr(logits, 'dtype', None)} "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    m, v = logits.shape
    if m * v > 2**31 - 1:
        raise ValueError("the kernel indexes with 32-bit integers: logits are too large")
    if host_words and m > ARGMAX_HOST_ROWS:
        raise ValueError(f"argmax's host words take at most {ARGMAX_HOST_ROWS} rows, got {m}")
    nsimd = 32 if v >= 8192 else NSIMD
    wide = v * logits.dtype.size % 16 == 0
    words = -(-m // 2) if host_words else 0
    tok, *host = launch(Launch(_argmax_host_spec(words) if words else _ARGMAX, [logits, _ints((m, v))],
                               [((m,), mx.int32)] + [((2,), mx.int32)] * words,
                               (m * 32 * nsimd, 1, 1), (32 * nsimd, 1, 1),
                               dict(T=logits.dtype, NSIMD=nsimd, WIDE=wide, U=ARGMAX_LOADS)))
    return (tok, tuple(host)) if host_words else tok


def embed(table: mx.array, tokens, qtype: str, k: int) -> mx.array:
    """Rows `tokens` of an embedding table (F16 [V, K], GGUF blocks [V, K/32 * BB] or K-quant
    super-blocks [V, K/256 * SB]) as fp16
    [T, K]. Token ids given on the host are checked; ids on the device that fall outside the
    table give zero rows."""
    if qtype not in EMBED_TYPES:
        raise ValueError(f"qtype must be one of {tuple(EMBED_TYPES)}, got {qtype!r}")
    code, per_block, bb = EMBED_TYPES[qtype]
    if k <= 0 or k % max(32, per_block):
        raise ValueError(f"K must be a positive multiple of {max(32, per_block)}, got {k}")
    want = mx.float16 if qtype == "f16" else mx.uint8
    if not isinstance(table, mx.array) or table.dtype != want or table.ndim != 2:
        raise ValueError(f"a {qtype} table must be a 2-D {want} array, got {getattr(table, 'dtype', None)}")
    row = k // per_block * bb
    if table.shape[1] != row:
        raise ValueError(f"a {qtype} table of K={k} has rows of {row}, got {table.shape[1]}")
    vocab = table.shape[0]
    if isinstance(tokens, mx.array):
        if tokens.dtype != mx.int32 or tokens.ndim != 1:
            raise ValueError(f"device tokens must be int32 [T], got {tokens.dtype} {tuple(tokens.shape)}")
        ids = tokens
    else:
        host = np.asarray(tokens).reshape(-1)
        if host.size == 0 or not np.issubdtype(host.dtype, np.integer):
            raise ValueError("tokens must be a non-empty list of integers")
        if host.min() < 0 or host.max() >= vocab:
            raise ValueError(f"token ids must be in 0..{vocab - 1}, got {host.min()}..{host.max()}")
        ids = index(int(host[0])) if host.size == 1 else table_constant(host)
    t = ids.shape[0]
    blocks = t * (k // 32)
    (out,) = launch(Launch(_EMBED, [table, ids, _ints((t, k, vocab))], [((t, k), mx.float16)],
                           (-(-blocks // 256) * 256, 1, 1), (256, 1, 1), dict(QTYPE=code)))
    return out
