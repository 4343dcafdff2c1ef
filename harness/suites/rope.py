"""The RoPE family's correctness suite: every kernel and form against reference/rope.py.

Shapes cover the grid of head dims, heads and sequence lengths without its full product: each
(head_dim, heads) pair meets every seq value across the pairs, and theta, freq_scale and the
position (0, random, last before 32768) rotate through them. Inputs are fresh random fp16 every
run, outputs are poisoned with NaN, and cache rows a kernel must not touch are compared bit for
bit with their initial values.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import reference.rope as ref
from harness.check import CheckCase, Comparison, compare, exact

TOL = 1e-3
HEAD_DIMS = (64, 128, 256)
HEADS = ((32, 32), (32, 8), (16, 8), (28, 4))
SEQS = (1, 7, 512, 4095)
THETAS = (1e4, 1e6)
FREQ_SCALES = (1.0, 0.25)
MAX_POSITION = 32768
EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    head_dim: int
    n_heads: int
    n_kv_heads: int
    seq: int
    pos: int
    theta: float
    freq_scale: float

    def row(self) -> dict:
        return dict(seq=self.seq, head_dim=self.head_dim, n_heads=self.n_heads,
                    n_kv_heads=self.n_kv_heads, pos=self.pos, theta=self.theta,
                    freq_scale=self.freq_scale)


def shapes(decode: bool = False, small: bool = False) -> list[Shape]:
    """The covering set of shapes (16); `decode` forces seq = 1. `small` keeps the structure with
    short sequences and positions (the same compile-time constants: heads per thread 1, 4, 8),
    for `lathe compile`, which only needs each kernel instantiation once."""
    seqs, max_position = ((1, 7, 16, 1024), 2048) if small else (SEQS, MAX_POSITION)
    out = []
    for a in range(len(SEQS)):  # a fourth round of head_dims, so every heads pair meets every seq
        head_dim = HEAD_DIMS[a % len(HEAD_DIMS)]
        for b, (n_heads, n_kv) in enumerate(HEADS):
            c = a * len(HEADS) + b
            seq = 1 if decode else seqs[(a + b) % len(seqs)]
            # Position: 0, the last that fits before max_position, or in between.
            pos = (0, max_position - seq, (max_position - seq) * (c + 1) // 17)[c % 3]
            out.append(Shape(head_dim, n_heads, n_kv, seq, pos, THETAS[b % 2],
                             FREQ_SCALES[(a + b // 2) % 2]))
    return out


def _fp16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Standard normal fp16 values, drawn by MLX (on the GPU where there is one) from a key the
    case's generator gives, then copied to the host for the reference: drawing them on the host
    was a quarter of the suite's time on the H200 (32 s of 121, logs/check-profile-6518f5e.log)."""
    key = mx.random.key(int(rng.integers(1 << 31)))
    return np.array(mx.random.normal(shape, key=key).astype(mx.float16))


def _random_cache(rng: np.random.Generator, n_kv: int, rows: int, head_dim: int) -> tuple[mx.array, mx.array]:
    """A large cache whose untouched rows are only compared bit for bit: random finite fp16
    bits (|x| < 2, subnormals included: the top exponent bit cleared), drawn on the device (a
    cache of 32768 rows took 57 ms to draw on the host and as long to copy), and a copy of its
    bits that no kernel sees. Both are evaluated here, before any in-place write."""
    key = mx.random.key(int(rng.integers(1 << 31)))
    bits = mx.random.randint(0, 1 << 16, (n_kv, rows, head_dim), dtype=mx.uint32, key=key).astype(mx.uint16)
    bits = bits & 0xBFFF
    initial = bits | 0  # a buffer of its own
    cache = bits.view(mx.float16)
    mx.eval(cache, initial)
    return cache, initial


def _untouched(what: str, out: mx.array, initial: mx.array, rows: slice) -> Comparison:
    """Rows a kernel must not touch, compared bit for bit on the device (the caches are up to
    64 MB: copying them back to compare on the host was most of a case's time)."""
    same = mx.array_equal(out[:, rows].view(mx.uint16), initial[:, rows])
    return exact(what, bool(same.item()), True)


def _norm_weight(rng: np.random.Generator, head_dim: int) -> np.ndarray:
    return (1.0 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)


# ---- rope / rope_neox ----------------------------------------------------------------------------
def _rope_case(neox: bool, variant: str, s: Shape) -> CheckCase:
    from kernels.rope import rope, rope_neox
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        x = _fp16(rng, s.seq, s.n_heads, s.head_dim)
        if variant == "position_ids":  # arbitrary, unsorted positions below MAX_POSITION
            positions = rng.integers(0, MAX_POSITION, s.seq).astype(np.int32)
            kw = dict(position_ids=mx.array(positions))
        else:
            positions = np.arange(s.pos, s.pos + s.seq)
            kw = dict(freqs=variant)
        with poisoned_outputs():
            out = (rope_neox if neox else rope)(mx.array(x), s.pos, theta=s.theta,
                                                 freq_scale=s.freq_scale, **kw)
            mx.eval(out)
        want = ref.rope(x, positions, s.theta, s.freq_scale, neox)
        return [compare("out", out, want, TOL)]

    return CheckCase("rope", "rope_neox" if neox else "rope", variant, s.row(), run)


# ---- fused and unfused RoPE + KV write -----------------------------------------------------------
def _kv_case(kernel: str, variant: str, s: Shape, *, neox: bool, norm: bool) -> CheckCase:
    import kernels.rope as kr
    from kernels.rope.paths import mlx_kv_write, unfused_kv_write
    from kernels.runtime import poisoned_outputs

    def run(rng: np.random.Generator) -> list[Comparison]:
        d, hq, hkv, seq, pos = s.head_dim, s.n_heads, s.n_kv_heads, s.seq, s.pos
        q, k, v = _fp16(rng, seq, hq * d), _fp16(rng, seq, hkv * d), _fp16(rng, seq, hkv * d)
        max_seq = pos + seq + 3  # rows after the written ones must stay untouched too
        (k0, k_initial), (v0, v_initial) = _random_cache(rng, hkv, max_seq, d), _random_cache(rng, hkv, max_seq, d)
        qn, kn = _norm_weight(rng, d), _norm_weight(rng, d)
        rope_kw = dict(theta=s.theta, freq_scale=s.freq_scale)
        caches, initial = (k0, v0), (k_initial, v_initial)
        with poisoned_outputs():
            if kernel.endswith("qkv_write"):  # one token as a vector, a prompt as [seq, width]
                qkv = np.concatenate([q, k, v], axis=1)
                qkv = mx.array(qkv[0] if seq == 1 else qkv)
                if norm:
                    res = kr.head_norm_rope_neox_qkv_write(qkv, mx.array(qn), mx.array(kn), *caches, pos,
                                                           n_heads=hq, eps=EPS, form=variant, **rope_kw)
                else:
                    f = kr.rope_neox_qkv_write if neox else kr.rope_qkv_write
                    res = f(qkv, *caches, pos, n_heads=hq, form=variant, **rope_kw)
            elif kernel.endswith("batch_kv_write"):
                f = kr.rope_neox_batch_kv_write if neox else kr.rope_batch_kv_write
                res = f(mx.array(q), mx.array(k), mx.array(v), *caches, pos, form=variant, **rope_kw)
            elif kernel == "head_norm_rope_neox_kv_write":
                res = kr.head_norm_rope_neox_kv_write(
                    mx.array(q), mx.array(k), mx.array(v), mx.array(qn), mx.array(kn), *caches, pos,
                    eps=EPS, form=variant, **rope_kw)
            else:
                norms = dict(q_norm=mx.array(qn), k_norm=mx.array(kn), eps=EPS) if norm else {}
                args = (mx.array(q), mx.array(k), mx.array(v), *caches, pos)
                if kernel == "unfused":
                    res = unfused_kv_write(*args, neox=neox, form=variant, **norms, **rope_kw)
                else:
                    res = mlx_kv_write(*args, neox=neox, **norms, **rope_kw)
            mx.eval(res)
        q3, k3 = q.reshape(seq, hq, d), k.reshape(seq, hkv, d)
        if norm:
            q3, k3 = ref.rms_norm(q3, qn, EPS), ref.rms_norm(k3, kn, EPS)
        positions = np.arange(pos, pos + seq)
        q_ref = ref.rope(q3, positions, s.theta, s.freq_scale, neox)
        k_ref = ref.rope(k3, positions, s.theta, s.freq_scale, neox).transpose(1, 0, 2)
        rows, before, after = slice(pos, pos + seq), slice(0, pos), slice(pos + seq, None)
        return [
            compare("q", np.array(res.q).reshape(seq, hq, d), q_ref, TOL),
            compare("k rows", np.array(res.k_cache[:, rows]), k_ref, TOL),
            exact("v rows", np.array(res.v_cache[:, rows]), v.reshape(seq, hkv, d).transpose(1, 0, 2)),
            _untouched("k rows before", res.k_cache, initial[0], before),
            _untouched("k rows after", res.k_cache, initial[0], after),
            _untouched("v rows before", res.v_cache, initial[1], before),
            _untouched("v rows after", res.v_cache, initial[1], after),
        ]

    label = kernel if kernel not in ("unfused", "mlx") else (
        f"{kernel}:{'head_norm_' if norm else ''}rope{'_neox' if neox else ''}_kv_write")
    return CheckCase("rope", label, variant, s.row(), run)


def _paged_kv_case(s: Shape, *, neox: bool, device_ids: bool, norm: bool = False, fused: bool = False) -> CheckCase:
    """rope_paged_kv_write: a batch's tokens at arbitrary positions into scattered slots of a
    block pool (vLLM's layouts, blocks of 16), every other row left bit for bit; position ids and
    slots from the host (checked there) or the device (device_ids); `norm`: Qwen3's per-head
    RMSNorm of Q and K first (q_norm, k_norm); `fused`: rope_paged_qkv_write, Q, K and V read
    from one fused QKV projection's rows."""
    import kernels.rope as kr
    from kernels.runtime import poisoned_outputs

    bs = 16

    def run(rng: np.random.Generator) -> list[Comparison]:
        d, hq, hkv, seq = s.head_dim, s.n_heads, s.n_kv_heads, s.seq
        blocks = -(-seq // bs) + 3
        q, k, v = _fp16(rng, seq, hq * d), _fp16(rng, seq, hkv * d), _fp16(rng, seq, hkv * d)
        positions = rng.integers(0, MAX_POSITION, seq).astype(np.int32)
        slots = rng.permutation(blocks * bs)[:seq].astype(np.int32)
        (k0, k_bits), (v0, v_bits) = (_random_cache(rng, blocks, bs * hkv, d) for _ in range(2))
        # vLLM's layouts, made contiguous on the host (an in-place write must land in the array given)
        k_cache = mx.array(np.ascontiguousarray(np.array(k0).reshape(blocks, bs, hkv, d // 8, 8).transpose(0, 2, 3, 1, 4)))
        v_cache = mx.array(np.ascontiguousarray(np.array(v0).reshape(blocks, bs, hkv, d).transpose(0, 2, 3, 1)))
        ids = (mx.array(positions), mx.array(slots)) if device_ids else (positions, slots)
        qn, kn = _norm_weight(rng, d), _norm_weight(rng, d)
        norms = dict(q_norm=mx.array(qn), k_norm=mx.array(kn), eps=EPS) if norm else {}
        kw = dict(theta=s.theta, freq_scale=s.freq_scale, neox=neox, **norms)
        with poisoned_outputs():
            if fused:
                res = kr.rope_paged_qkv_write(mx.array(np.concatenate([q, k, v], axis=1)), k_cache, v_cache, *ids,
                                              n_heads=hq, **kw)
            else:
                res = kr.rope_paged_kv_write(mx.array(q), mx.array(k), mx.array(v), k_cache, v_cache, *ids, **kw)
            mx.eval(res)
        # the pool as rows [blocks * BS, Hkv, D]
        k_rows = np.array(res.k_cache.transpose(0, 3, 1, 2, 4).reshape(blocks * bs, hkv, d))
        v_rows = np.array(res.v_cache.transpose(0, 3, 1, 2).reshape(blocks * bs, hkv, d))
        k_before = np.array(k_bits.reshape(blocks * bs, hkv, d))
        v_before = np.array(v_bits.reshape(blocks * bs, hkv, d))
        others = np.setdiff1d(np.arange(blocks * bs), slots)
        q3, k3 = q.reshape(seq, hq, d), k.reshape(seq, hkv, d)
        if norm:
            q3, k3 = ref.rms_norm(q3, qn, EPS), ref.rms_norm(k3, kn, EPS)
        q_ref = ref.rope(q3, positions, s.theta, s.freq_scale, neox)
        k_ref = ref.rope(k3, positions, s.theta, s.freq_scale, neox)
        return [
            compare("q", np.array(res.q).reshape(seq, hq, d), q_ref, TOL),
            compare("k at its slots", k_rows[slots], k_ref, TOL),
            exact("v at its slots", v_rows[slots], v.reshape(seq, hkv, d)),
            exact("k rows of other slots", (k_rows[others].view(np.uint16) == k_before[others]).all(), True),
            exact("v rows of other slots", (v_rows[others].view(np.uint16) == v_before[others]).all(), True),
        ]

    return CheckCase("rope", "rope_paged_qkv_write" if fused else "rope_paged_kv_write",
                     ("head norms, " if norm else "") + ("neox" if neox else "pairs")
                     + (", device ids" if device_ids else ""), s.row(), run)


def check_cases(small: bool = False) -> list[CheckCase]:
    """Every RoPE kernel, pairing, frequency path and cache-write form over the covering shapes
    (`small`: the same cases on short inputs, see `shapes`)."""
    shapes_ = lambda decode=False: shapes(decode, small)  # noqa: E731
    cases: list[CheckCase] = []
    for s in shapes_():
        cases += [_rope_case(False, v, s) for v in ("table", "inline")]
        cases += [_rope_case(True, v, s) for v in ("table", "inline", "position_ids")]
    for form in ("in_place", "functional"):
        for s in shapes_(decode=True):
            cases.append(_kv_case("rope_qkv_write", form, s, neox=False, norm=False))
            cases.append(_kv_case("rope_neox_qkv_write", form, s, neox=True, norm=False))
        for s in shapes_():
            cases.append(_kv_case("rope_batch_kv_write", form, s, neox=False, norm=False))
            cases.append(_kv_case("rope_neox_batch_kv_write", form, s, neox=True, norm=False))
            cases.append(_kv_case("head_norm_rope_neox_kv_write", form, s, neox=True, norm=True))
        for s in shapes_()[::2]:  # a fused QKV projection's output read in place, prompts included
            cases.append(_kv_case("rope_qkv_write", form, s, neox=False, norm=False))
            cases.append(_kv_case("head_norm_rope_neox_qkv_write", form, s, neox=True, norm=True))
        # The unfused sequences the fused kernels replace compute the same thing.
        for s in shapes_()[::3]:
            for neox, norm in ((False, False), (True, False), (True, True)):
                cases.append(_kv_case("unfused", form, s, neox=neox, norm=norm))
    dims = {}  # a batch over the block pool: the first shape of each head_dim the pool takes
    for s in shapes_():
        if s.head_dim % 8 == 0:
            dims.setdefault(s.head_dim, []).append(s)
    for s in [found[0] for found in dims.values()] + [found[-1] for found in dims.values()]:
        cases.append(_paged_kv_case(s, neox=False, device_ids=False))
        cases.append(_paged_kv_case(s, neox=True, device_ids=True))
        if s.head_dim % 64 == 0:  # Qwen3's head norms in the same launch
            cases.append(_paged_kv_case(s, neox=True, device_ids=bool(s.seq % 2), norm=True))
        # the fused QKV projection's rows read at a stride and offsets (serve's batched steps)
        cases.append(_paged_kv_case(s, neox=s.head_dim % 64 == 0, device_ids=True, norm=s.head_dim % 64 == 0,
                                    fused=True))
        cases.append(_paged_kv_case(s, neox=False, device_ids=False, fused=True))
    for s in shapes_()[1::3]:  # the MLX built-in peer path, so that benchmarks compare like with like
        for neox, norm in ((False, False), (True, True)):
            cases.append(_kv_case("mlx", "peer", s, neox=neox, norm=norm))
    return cases


# ---- reference self-checks (CPU): the references against independent opinions ------------------
def _vs_mlx_fast_rope(neox: bool, head_dim: int, pos: int, theta: float, scale: float) -> CheckCase:
    def run(rng: np.random.Generator) -> list[Comparison]:
        seq, heads = 9, 3
        x = rng.standard_normal((seq, heads, head_dim)).astype(np.float32)
        xm = mx.array(x.transpose(1, 0, 2)[None])  # mx.fast.rope wants [B, heads, seq, D]
        got = mx.fast.rope(xm, head_dim, traditional=not neox, base=theta, scale=scale,
                           offset=pos, stream=mx.cpu)
        got = np.array(got)[0].transpose(1, 0, 2)
        want = ref.rope(x, np.arange(pos, pos + seq), theta, scale, neox)
        # float32 angles at positions up to ~4k: errors near 1e-5 relative
        return [compare("mx.fast.rope", got, want, 1e-4)]

    shape = dict(head_dim=head_dim, pos=pos, theta=theta, freq_scale=scale)
    return CheckCase("rope", "reference.rope_neox" if neox else "reference.rope",
                     "vs mx.fast.rope (cpu, fp32)", shape, run, needs_gpu=False)


def _relative_position(neox: bool, head_dim: int, theta: float) -> CheckCase:
    """<rope(q, m), rope(k, n)> depends only on m - n: the property RoPE exists for."""

    def run(rng: np.random.Generator) -> list[Comparison]:
        q, k = rng.standard_normal((2, 1, 1, head_dim))
        # The error is measured against |q||k|, the dot product's scale: a ratio to the dot
        # product itself would blow up whenever a random q and k happen to be near-orthogonal.
        scale = np.linalg.norm(q) * np.linalg.norm(k)
        out = []
        for m, n in ((5, 2), (1000, 37), (20000, 19999)):
            base = np.sum(ref.rope(q, [m], theta, 1.0, neox) * ref.rope(k, [n], theta, 1.0, neox))
            for shift in (1, 123, 4096):
                moved = np.sum(ref.rope(q, [m + shift], theta, 1.0, neox)
                               * ref.rope(k, [n + shift], theta, 1.0, neox))
                out.append(Comparison(f"m={m},n={n},+{shift}", abs(moved - base) / scale, 1e-10))
        return out

    return CheckCase("rope", "reference.rope_neox" if neox else "reference.rope",
                     "relative position", dict(head_dim=head_dim, theta=theta), run, needs_gpu=False)


def _rms_norm_vs_mlx(head_dim: int) -> CheckCase:
    def run(rng: np.random.Generator) -> list[Comparison]:
        x = rng.standard_normal((5, 4, head_dim)).astype(np.float32)
        w = (1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)
        got = mx.fast.rms_norm(mx.array(x), mx.array(w), EPS, stream=mx.cpu)
        return [compare("mx.fast.rms_norm", np.array(got), ref.rms_norm(x, w, EPS), 1e-5)]

    return CheckCase("rope", "reference.rms_norm", "vs mx.fast.rms_norm (cpu, fp32)",
                     dict(head_dim=head_dim), run, needs_gpu=False)


def reference_cases() -> list[CheckCase]:
    cases = []
    for neox in (False, True):
        for head_dim, pos, theta, scale in ((64, 0, 1e4, 1.0), (128, 3000, 1e6, 0.25),
                                            (256, 777, 5e5, 1.0)):
            cases.append(_vs_mlx_fast_rope(neox, head_dim, pos, theta, scale))
        for head_dim, theta in ((64, 1e4), (128, 1e6)):
            cases.append(_relative_position(neox, head_dim, theta))
    cases += [_rms_norm_vs_mlx(d) for d in HEAD_DIMS]
    return cases
