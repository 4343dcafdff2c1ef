"""The decode loop's kernel variants (device-verified on the H200: tests/test_kernel_decode.py).

- `unfused`: one of lathe's kernels per op: embedding, RMSNorm, the Q4_0/Q8_0 GEMV (`linear`),
  RoPE + KV write (in place), flash decode, SwiGLU; residual adds are MLX adds.
- `fused`: RMSNorm folded into one QKV GEMV and one gate+up GEMV over concatenated matrices,
  a decode token's RoPE + KV write folded into the attention launch (Llama; Qwen3's head norms
  fold into a RoPE + KV write of their own), SiLU folded into the down GEMV, the final norm into
  the output GEMV.

KV cache (`kv=`): `contiguous` (head-major [Hkv, max_seq, D] per layer, the default) or `paged`
(vLLM's block pool, blocks of BLOCK_SIZE tokens handed out in a fixed shuffled order through a
block table, unused slots NaN so that a read past the context shows): RoPE, then
reshape_and_cache, then paged_attention (a prompt: prefill_attention over the pool). The paged form costs the RoPE + KV-write fusion (two RoPE launches and the
cache write instead of one launch).

Same interface as harness.decode.ReferenceDecoder (forward, reset, pos), so generate() and Session
run them, in every mode (compiled: KernelDecoder.compiled_step). Matrices
stay in their GGUF blocks; F16 matrices (the f16 presets) go through MLX's matmul. Prompts
(more than 4 tokens) take the batched GEMV path and kernels.attention.prefill_attention.
`kernel_plan` lists the steps forward() dispatches (for --show-plan); forward() is written out
rather than replaying that list as the reference variant does: making it the executed list is
the next step, once the variants have run on the device.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from harness.plan import Step
from harness.models import Model
from kernels import options
from kernels.runtime import resident

VARIANTS = ("unfused", "fused")
KV_LAYOUTS = ("contiguous", "paged")
BLOCK_SIZE = 16  # tokens a block of the paged cache (vLLM's default)
FUSED_UP_TO = 4  # rows of X the fused RMSNorm+GEMV takes (kernels.gemv.MAX_M)
# Two options of kernels.options shape the fused variant, read when a decoder is built (its
# plan and its forward() agree): rope_in_attention, a decode token's RoPE + KV write inside the
# attention launch (attention.rope_flash_decode); seams, each layer's output projection and the
# next block's RMSNorm+GEMV as one launch (kernels.gemv.seam): O | gate+up, then down | the next
# layer's QKV (or the head), 64 launches a Llama token fewer (kernels/loop/NOTES.md, "Seams, the
# default").


def rope_in_attention(c) -> bool:
    """Whether a fused contiguous decode token's RoPE + KV write rides in its attention launch:
    models without head norms (Qwen3's norm in a RoPE + KV write of its own), unless turned off.
    The plan and the decoder both ask here, so the plan shows what runs."""
    return options.get("rope_in_attention") and not c.head_norm


def seams_apply(c, types: dict[str, str]) -> bool:
    """Whether the fused variant's decode tokens run seams (kernels.gemv.seam): unless turned off,
    when every matrix that seams pair is in one block type (Q4_0 or Q8_0; both GEMVs of a seam
    share one instantiation). `types`: GGUF tensor name -> type name, any case."""
    head = "token_embd.weight" if c.tied else "output.weight"
    names = [head] + [f"blk.{i}.{n}.weight" for i in range(c.n_layers)
                      for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    kinds = {types[n].lower() for n in names}
    return options.get("seams") and len(kinds) == 1 and kinds <= {"q4_0", "q8_0"}


def kernel_plan(c, fused: bool, paged: bool = False, overflow: bool = False,
                seams: bool = False, rope_attention: bool | None = None) -> list[Step]:
    """The steps each decode token replays (one dispatch each, MLX adds included); `overflow`:
    the contiguous cache wraps around (RoPE apart from the cache writes, see KernelDecoder);
    `seams` (fused): each output projection shares its launch with the next RMSNorm+GEMV;
    `rope_attention` (fused): RoPE + KV write inside attention (default: rope_in_attention)."""
    gemv = "lathe gemv_v2 (Q4_0/Q8_0)"
    seams = seams and fused
    rope_attention = rope_in_attention(c) if rope_attention is None else rope_attention
    steps = [Step("embed", "lathe embed", ("token",), ("x",), ("token_embd.weight",), ("token",))]
    for i in range(c.n_layers):
        b = f"blk.{i}."
        if seams and i > 0:
            pass  # this layer's QKV came out of the last seam of the layer before
        elif fused:
            steps += [Step("rmsnorm_linear", "lathe rmsnorm_gemv", ("x",), ("qkv",),
                           (b + "attn_norm.weight", b + "attn_qkv (q|k|v)"), layer=i)]
        else:
            steps += [Step("rms_norm", "lathe rmsnorm", ("x",), ("h",), (b + "attn_norm.weight",), layer=i)]
            steps += [Step("linear", gemv, ("h",), (n,), (b + f"attn_{n}.weight",), layer=i) for n in "qkv"]
        apart = paged or overflow  # RoPE in launches of its own, then the cache writes
        if c.head_norm and (apart or not fused):  # the fused contiguous path norms in its RoPE write
            steps += [Step("head_norm", "lathe head_rmsnorm", (n,), (n,), (b + f"attn_{n}_norm.weight",),
                           layer=i) for n in "qk"]
        if apart:
            steps += [Step("rope", "lathe rope_neox" if c.neox else "lathe rope", (n,), (n,), (), ("pos",),
                           layer=i) for n in "qk"]
        if paged:
            steps += [Step("kv_write", "lathe reshape_and_cache", ("k", "v"), (f"cache.{i}",), (), ("slot",),
                           layer=i),
                      Step("attention", "lathe paged_attention v2 (+ combine past 2048)",
                           ("q", f"cache.{i}", "block_table"), ("o",), (), ("kv_len",), layer=i)]
        elif overflow:
            steps += [Step("kv_write", "lathe cache_write", (n,), (f"cache.{i}",), (), ("pos % max_seq",),
                           layer=i) for n in "kv"]
            steps += [Step("attention", "lathe flash_decode (+ combine past 2048)", ("q", f"cache.{i}"), ("o",),
                           (), ("min(kv_len, max_seq)",), layer=i)]
        elif fused and rope_attention:  # RoPE and the KV write ride in attention
            steps += [Step("rope_attention", "lathe rope_flash_decode (+ combine past 2048)",
                           ("qkv", f"cache.{i}"), ("o", f"cache.{i}"), (), ("pos",), layer=i)]
        else:
            if fused:
                rope = "lathe head_norm_rope_neox_qkv_write" if c.head_norm else "lathe rope_qkv_write"
                steps += [Step("rope_kv_write", rope, ("qkv",), ("q", f"cache.{i}"),
                               (b + "attn_q_norm.weight", b + "attn_k_norm.weight") if c.head_norm else (),
                               ("pos",), layer=i)]
            else:
                steps += [Step("rope_kv_write", "lathe rope_batch_kv_write", ("q", "k", "v"),
                               ("q", f"cache.{i}"), (), ("pos",), layer=i)]
            steps += [Step("attention", "lathe flash_decode (+ combine past 2048)",
                           ("q", f"cache.{i}"), ("o",), (), ("kv_len",), layer=i)]
        if seams:
            nxt = (f"blk.{i + 1}.attn_norm.weight", f"blk.{i + 1}.attn_qkv (q|k|v)") if i + 1 < c.n_layers \
                else ("output_norm.weight", "token_embd.weight" if c.tied else "output.weight")
            steps += [Step("seam", "lathe seam (gemv + residual | rmsnorm_gemv)", ("o", "x"), ("x", "gate_up"),
                           (b + "attn_output.weight", b + "ffn_norm.weight", b + "ffn_gate_up (gate|up)"), layer=i),
                      Step("seam", "lathe seam (silu_down_gemv + residual | rmsnorm_gemv)", ("gate_up", "x"),
                           ("x", "qkv" if i + 1 < c.n_layers else "logits"), (b + "ffn_down.weight", *nxt), layer=i)]
            continue
        if fused:  # the residual adds ride in the GEMVs' epilogue
            steps += [Step("linear_residual", gemv + " + residual", ("o", "x"), ("x",),
                           (b + "attn_output.weight",), layer=i),
                      Step("rmsnorm_linear", "lathe rmsnorm_gemv", ("x",), ("gate_up",),
                           (b + "ffn_norm.weight", b + "ffn_gate_up (gate|up)"), layer=i),
                      Step("silu_down_residual", "lathe silu_down_gemv + residual", ("gate_up", "x"),
                           ("x",), (b + "ffn_down.weight",), layer=i)]
            continue
        steps += [Step("linear", gemv, ("o",), ("attn",), (b + "attn_output.weight",), layer=i),
                  Step("add", "mx.add", ("x", "attn"), ("x",), layer=i)]
        steps += [Step("rms_norm", "lathe rmsnorm", ("x",), ("h",), (b + "ffn_norm.weight",), layer=i),
                  Step("linear", gemv, ("h",), ("gate",), (b + "ffn_gate.weight",), layer=i),
                  Step("linear", gemv, ("h",), ("up",), (b + "ffn_up.weight",), layer=i),
                  Step("swiglu", "lathe swiglu", ("gate", "up"), ("a",), layer=i),
                  Step("linear", gemv, ("a",), ("ffn",), (b + "ffn_down.weight",), layer=i),
                  Step("add", "mx.add", ("x", "ffn"), ("x",), layer=i)]
    out = "token_embd.weight" if c.tied else "output.weight"
    if seams:
        pass  # the head came out of the last seam
    elif fused:
        steps += [Step("rmsnorm_linear", "lathe rmsnorm_gemv", ("x",), ("logits",), ("output_norm.weight", out))]
    else:
        steps += [Step("rms_norm", "lathe rmsnorm", ("x",), ("h",), ("output_norm.weight",)),
                  Step("linear", gemv, ("h",), ("logits",), (out,))]
    return steps


class KernelDecoder:
    """Prefill and decode with lathe's kernels over a loaded GGUF model (see the module doc)."""

    def __init__(self, model: Model, max_seq: int, variant: str = "fused", kv: str = "contiguous",
                 overflow: bool = False) -> None:
        """`overflow`: decode steps past max_seq wrap around the contiguous cache (circular
        overflow, as the reference variant): token p is written at row p % max_seq over the
        oldest token and attends to all the rows it holds. The fused RoPE + KV write kernels
        take one position for the angle and the row, so such a decoder rotates Q and K in
        launches of their own and writes K and V with cache_write (4 launches a layer more).
        Without it, a decode step past max_seq is a clear error before any launch."""
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if kv not in KV_LAYOUTS:
            raise ValueError(f"kv must be one of {KV_LAYOUTS}, got {kv!r}")
        if overflow and kv == "paged":
            raise ValueError("circular overflow is for the contiguous cache; a paged cache grows by blocks")
        c = model.config
        if max_seq < 1 or max_seq > c.ctx:
            raise ValueError(f"max_seq must be in 1..{c.ctx} (the model's context), got {max_seq}")
        self.config, self.max_seq, self.variant, self.kv, self.overflow = c, max_seq, variant, kv, overflow
        self.fused, self.paged = variant == "fused", kv == "paged"
        self.types = {n: t.lower() for n, t in model.types.items()}
        self.w, self.nk = {}, {}
        for name, t in model.tensors.items():
            if name.endswith("norm.weight"):
                continue
            if t.dtype == np.uint8:
                bb = 18 if self.types[name] == "q4_0" else 34
                self.w[name] = resident(mx.array(t))
                self.nk[name] = (t.shape[0], t.shape[1] // bb * 32)
            else:
                self.w[name] = resident(mx.array(np.asarray(t, dtype=np.float16)))
                self.nk[name] = tuple(t.shape)
        norms = [n for n in model.tensors if n.endswith("norm.weight")]
        self.g16 = {n: resident(mx.array(np.asarray(model.tensors[n], dtype=np.float16))) for n in norms}
        self.g32 = {n: resident(mx.array(np.asarray(model.tensors[n], dtype=np.float32))) for n in norms}
        if self.fused:
            self._concat("attn_qkv", ("attn_q", "attn_k", "attn_v"))
            self._concat("ffn_gate_up", ("ffn_gate", "ffn_up"))
        self.seams = self.fused and seams_apply(c, self.types)
        self.rope_attention = self.fused and rope_in_attention(c)
        if self.seams:
            from kernels.gemv import seam_queue

            self.queues = [(seam_queue(), seam_queue()) for _ in range(c.n_layers)]
        mx.clear_cache()  # the host-written copies of the weights (kernels.runtime.resident)
        self.plan = kernel_plan(c, self.fused, self.paged, overflow, self.seams, self.rope_attention)
        self.resize(max_seq)

    def resize(self, max_seq: int) -> None:
        """An empty cache of max_seq rows, the weights kept (a run over several depths sizes the
        cache for each: a compiled step's attention grid covers the whole cache)."""
        if max_seq < 1 or max_seq > self.config.ctx:
            raise ValueError(f"max_seq must be in 1..{self.config.ctx} (the model's context), got {max_seq}")
        self.max_seq = max_seq
        if self.paged:
            # One sequence's blocks, scattered over the pool in a fixed shuffle: every read and
            # write goes through the table, as with a pool shared by many sequences.
            blocks = -(-max_seq // BLOCK_SIZE)
            self.table = np.random.default_rng(0).permutation(blocks).astype(np.int32)[None]
            self.table_dev = resident(mx.array(self.table))
        self._compiled = None  # traced for the old size
        self.reset()

    def _concat(self, fused_name: str, parts: tuple[str, ...]) -> None:
        from kernels.gemv import concat_rows

        for i in range(self.config.n_layers):
            names = [f"blk.{i}.{p}.weight" for p in parts]
            kinds = {self.types[n] for n in names}
            if len(kinds) != 1 or kinds & {"f16", "f32"}:
                raise ValueError(f"the fused variant needs {parts} in one block type (Q4_0 or Q8_0), "
                                 f"got {sorted(kinds)}")
            name = f"blk.{i}.{fused_name}.weight"
            self.w[name] = concat_rows([self.w.pop(n) for n in names])
            self.nk[name] = (sum(self.nk[n][0] for n in names), self.nk[names[0]][1])
            self.types[name] = kinds.pop()
            # Evaluated here, once: a lazy concatenation captured by mx.compile is part of the
            # traced step and was redone every token (64 weight copies per Llama-3-8B token,
            # seen in Nsight Compute). The parts are dropped: nothing reads them any more.
            mx.eval(self.w[name])

    @property
    def label(self) -> str:
        """The variant as results name it: the paged cache is marked (fused/paged)."""
        return f"{self.variant}/paged" if self.paged else self.variant

    def reset(self) -> None:
        c = self.config
        if self.paged:  # vLLM's layouts; NaN in every slot not yet written
            blocks, d = self.table.shape[1], c.head_dim
            k_shape, v_shape = (blocks, c.n_kv_heads, d // 8, BLOCK_SIZE, 8), (blocks, c.n_kv_heads, d, BLOCK_SIZE)
            self.k = [mx.full(k_shape, float("nan"), mx.float16) for _ in range(c.n_layers)]
            self.v = [mx.full(v_shape, float("nan"), mx.float16) for _ in range(c.n_layers)]
        else:
            shape = (c.n_kv_heads, self.max_seq, c.head_dim)
            self.k = [mx.zeros(shape, mx.float16) for _ in range(c.n_layers)]
            self.v = [mx.zeros(shape, mx.float16) for _ in range(c.n_layers)]
        self.pos = 0

    def _slots(self, pos, t: int):
        """Paged slots (block * BLOCK_SIZE + offset) of positions pos .. pos+t-1: host ints, or
        int32[1] on the device for a compiled step's position array."""
        if isinstance(pos, int):
            p = np.arange(pos, pos + t)
            return self.table[0, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        return mx.take(self.table_dev[0], pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE

    def _contiguous_attention(self, i: int, x: mx.array, t: int, pos, qkv=None) -> mx.array:
        """Layer i's attention over the contiguous cache: projections, then RoPE (and Qwen3's head
        norms) fused with the in-place KV write, then attention; o [t, Hq * D]. `qkv`: the fused
        projection's output when a seam made it already (else made here from x)."""
        from kernels import attention, rope

        if self.overflow and t == 1:
            return self._wrapping_attention(i, x, pos, qkv)
        c, b, hd = self.config, f"blk.{i}.", self.config.head_dim
        if self.fused:  # RoPE (and Qwen3's head norms) read Q, K, V in place in the QKV output
            qkv = self._qkv(i, x, qkv)
            if t == 1 and self.rope_attention:  # RoPE and the KV write ride in attention
                o, self.k[i], self.v[i] = attention.rope_flash_decode(
                    qkv, self.k[i], self.v[i], pos, 1.0 / math.sqrt(hd), n_heads=c.n_heads,
                    theta=c.rope_theta, neox=c.neox)
                return o.reshape(1, -1)
            if c.head_norm:
                rot = rope.head_norm_rope_neox_qkv_write(
                    qkv, self.g32[b + "attn_q_norm.weight"], self.g32[b + "attn_k_norm.weight"],
                    self.k[i], self.v[i], pos, n_heads=c.n_heads, eps=c.eps, theta=c.rope_theta)
            else:
                rot = rope.rope_qkv_write(qkv, self.k[i], self.v[i], pos, n_heads=c.n_heads,
                                          theta=c.rope_theta, neox=c.neox)
        else:
            write = rope.rope_neox_batch_kv_write if c.neox else rope.rope_batch_kv_write
            rot = write(*self._projections(i, x, t), self.k[i], self.v[i], pos, theta=c.rope_theta)
        self.k[i], self.v[i] = rot.k_cache, rot.v_cache
        scale = 1.0 / math.sqrt(hd)
        if t == 1:
            lens = [pos + 1] if isinstance(pos, int) else pos + 1
            o = attention.flash_decode(rot.q.reshape(1, c.n_heads, hd), self.k[i][None], self.v[i][None],
                                       lens, scale, after=rot.written)
        else:  # a prompt: causal, each token over the cache up to its own position
            o = attention.prefill_attention(rot.q.reshape(t, c.n_heads, hd), self.k[i], self.v[i],
                                            pos, scale, after=rot.written)
        return o.reshape(t, -1)

    def _rotated(self, i: int, x: mx.array, t: int, pos, qkv=None) -> tuple[mx.array, mx.array, mx.array]:
        """Layer i's Q, K (rotated at positions pos..) and V, [t, heads, D]: RoPE in launches of
        its own (the paged and the wrapping paths)."""
        from kernels import rope

        c = self.config
        q, k, v = self._projections(i, x, t, qkv)
        rotate = rope.rope_neox if c.neox else rope.rope
        return rotate(q, pos, theta=c.rope_theta), rotate(k, pos, theta=c.rope_theta), v

    def _wrapping_attention(self, i: int, x: mx.array, pos, qkv=None) -> mx.array:
        """Layer i's attention for one decode token over a cache that may wrap around: K and V
        written at row pos % max_seq, attention over the min(pos + 1, max_seq) rows held (their
        order does not matter to softmax); o [1, Hq * D]."""
        from kernels import attention, rope

        c = self.config
        q, k, v = self._rotated(i, x, 1, pos, qkv)
        row = pos % self.max_seq  # an int, or an int32[1] array in a compiled step
        lens = [min(pos + 1, self.max_seq)] if isinstance(pos, int) else mx.minimum(pos + 1, self.max_seq)
        self.k[i], k_written = rope.cache_write(k.reshape(1, -1), self.k[i], row)
        self.v[i], v_written = rope.cache_write(v.reshape(1, -1), self.v[i], row)
        o = attention.flash_decode(q.reshape(1, c.n_heads, c.head_dim), self.k[i][None], self.v[i][None], lens,
                                   1.0 / math.sqrt(c.head_dim), after=mx.concatenate([k_written, v_written]))
        return o.reshape(1, -1)

    def _projections(self, i: int, x: mx.array, t: int, qkv=None) -> tuple[mx.array, mx.array, mx.array]:
        """Layer i's Q, K, V [t, heads, D], Qwen3's head norms applied, not yet rotated (the paths
        whose RoPE is not fused into the projection's output: unfused, paged)."""
        from kernels import gemv, loop, rope

        c, b, hd = self.config, f"blk.{i}.", self.config.head_dim
        if self.fused:
            qkv = self._qkv(i, x, qkv)
            q, k, v = gemv.split(qkv, (c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd))
        else:
            h = loop.rmsnorm(x, self.g16[b + "attn_norm.weight"], c.eps)
            q, k, v = (self._linear(h, b + f"attn_{n}.weight") for n in "qkv")
        q, k, v = q.reshape(t, c.n_heads, hd), k.reshape(t, c.n_kv_heads, hd), v.reshape(t, c.n_kv_heads, hd)
        if c.head_norm:
            q = rope.head_rmsnorm(q, self.g32[b + "attn_q_norm.weight"], c.eps)
            k = rope.head_rmsnorm(k, self.g32[b + "attn_k_norm.weight"], c.eps)
        return q, k, v

    def _paged_attention(self, i: int, x: mx.array, t: int, pos, qkv=None) -> mx.array:
        """Layer i's attention over the paged cache: projections, head norms, RoPE, the cache
        write, attention; o [t, Hq * D]."""
        from kernels import attention

        c = self.config
        q, k, v = self._rotated(i, x, t, pos, qkv)
        self.k[i], self.v[i], written = attention.reshape_and_cache(k, v, self.k[i], self.v[i],
                                                                    self._slots(pos, t))
        scale = 1.0 / math.sqrt(c.head_dim)
        if t == 1:
            lens = [pos + 1] if isinstance(pos, int) else pos + 1
            table = self.table if isinstance(pos, int) else self.table_dev
            o = attention.paged_attention(q, self.k[i], self.v[i], table, lens, scale, after=written)
        else:
            o = attention.prefill_attention(q, self.k[i], self.v[i], pos, scale, block_table=self.table[0],
                                            after=written)
        return o.reshape(t, -1)

    # -- ops --------------------------------------------------------------------------------------
    def _qkv(self, i: int, x: mx.array, qkv=None) -> mx.array:
        """Layer i's fused QKV output: `qkv` when a seam made it, else RMSNorm+GEMV of x."""
        b = f"blk.{i}."
        return self._norm_linear(x, b + "attn_norm.weight", b + "attn_qkv.weight") if qkv is None else qkv

    def _seam(self, i: int, second: bool, x: mx.array, residual: mx.array, norm: str,
              name: str) -> tuple[mx.array, mx.array]:
        """Layer i's first seam (second=False: O + residual | RMSNorm+GEMV gate+up, x = o) or its
        second (down of silu(gate) * up + residual | RMSNorm+GEMV of the next QKV or the head,
        x = gate_up): (the residual stream, the next projection's output), one launch."""
        from kernels.gemv import seam

        wa = f"blk.{i}." + ("ffn_down.weight" if second else "attn_output.weight")
        n_a, k_a = self.nk[wa]
        n_b, _ = self.nk[name]
        return seam(x, self.w[wa], n_a, k_a, residual, self.g16[norm], self.config.eps, self.w[name], n_b,
                    self.types[wa], swiglu=second, queue=self.queues[i][second])

    def _linear(self, x: mx.array, name: str) -> mx.array:
        from kernels.gemv import linear

        n, k = self.nk[name]
        if self.types[name] in ("q4_0", "q8_0"):
            return linear(x, self.w[name], self.types[name], n, k)
        return x @ self.w[name].T

    def _norm_linear(self, x: mx.array, norm: str, name: str) -> mx.array:
        from kernels.gemv import rmsnorm_gemv
        from kernels.loop import rmsnorm

        if self.fused and x.shape[0] <= FUSED_UP_TO and self.types[name] in ("q4_0", "q8_0"):
            n, k = self.nk[name]
            return rmsnorm_gemv(x, self.g16[norm], self.config.eps, self.w[name], self.types[name], n, k)
        return self._linear(rmsnorm(x, self.g16[norm], self.config.eps), name)

    def forward(self, tokens) -> mx.array:
        """Logits [len(tokens), vocab] (float32) for tokens at positions pos..; advances pos."""
        if isinstance(tokens, mx.array):
            ids = tokens.reshape(-1).astype(mx.int32)
        else:
            ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
        t = ids.size if isinstance(ids, mx.array) else len(ids)
        if t == 0:
            raise ValueError("tokens must not be empty")
        if self.pos + t > self.max_seq and (t > 1 or not self.overflow):
            raise ValueError(f"{self.pos + t} tokens do not fit the cache of {self.max_seq}: prompts must "
                             f"fit; decode steps wrap around only in a decoder made with overflow=True")
        if not isinstance(ids, mx.array):
            # Host tokens do not come out of the graph that wrote the cache, so nothing orders
            # this step's kernels after those in-place writes (kernels.rope.Rotated): finish
            # them first. Free when they are done (step mode); a device token (pipelined,
            # chained) is ordered by its data.
            mx.eval(self.k, self.v)
        logits = self.layers(ids, t, self.pos).astype(mx.float32)
        self.pos += t
        return logits

    def greedy(self, logits: mx.array) -> mx.array:
        """The next token id (int32[1], on the device): our argmax kernel over the last row of
        logits, read in the head's fp16 in a compiled step (no converted copy, no gather)."""
        from kernels import loop

        return loop.argmax(logits[-1:])

    def compiled_step(self, ordered: bool = False):
        """One decode step as an mx.compile'd function of (token, pos, *k caches, *v caches) ->
        (logits, *k caches, *v caches), traced once per decoder, the logits fp16 as the output
        head writes them (forward() returns them as float32): the position is an int32[1]
        array, so the RoPE + KV write and attention read it on the device, and attention's grid
        is sized for max_seq (kernels.attention.flash_decode). Host work per token is one call.
        By default the caches are evaluated before the call: a token from the host is not ordered
        after in-place writes still pending in a lazy graph (forward() does the same; on the
        H200 such a call read stale rows), and this is free when they are done. `ordered=True`
        gives the bare step for a caller whose token comes out of the graph that wrote the
        caches (the previous step's argmax), so that steps can be queued ahead (pipelined)."""
        if self._compiled is None:
            n = self.config.n_layers

            def step(token, pos, *caches):
                held = self.k, self.v
                self.k, self.v = list(caches[:n]), list(caches[n:])
                try:
                    logits = self.layers(token.reshape(-1), 1, pos)
                    return (logits, *self.k, *self.v)
                finally:
                    self.k, self.v = held

            self._compiled = mx.compile(step)
        if ordered:
            return self._compiled
        compiled = self._compiled

        def run(token, pos, *caches):
            mx.eval(caches)
            return compiled(token, pos, *caches)

        return run

    def layers(self, ids, t: int, pos) -> mx.array:
        """The model over t tokens at positions pos.. (an int; an int32[1] array in a compiled
        step), K and V written into self.k / self.v in place; the logits as the head wrote them
        (fp16, or float32 from an F32 output matrix)."""
        from kernels import gemv, loop

        c = self.config
        embd = "token_embd.weight"
        x = loop.embed(self.w[embd], ids, self.types[embd] if self.types[embd] != "f32" else "f16", c.d_model)
        attend = self._paged_attention if self.paged else self._contiguous_attention
        if self.seams and t <= FUSED_UP_TO:
            return self._seamed_layers(x, t, pos, attend)
        for i in range(c.n_layers):
            b = f"blk.{i}."
            o = attend(i, x, t, pos)
            wo, wd = b + "attn_output.weight", b + "ffn_down.weight"
            if self.fused and t <= FUSED_UP_TO and self.types[wo] in ("q4_0", "q8_0"):
                x = gemv.gemv_v2(o, self.w[wo], self.types[wo], *self.nk[wo], residual=x)
            else:
                x = x + self._linear(o, wo)
            if self.fused and t <= FUSED_UP_TO:
                gu = self._norm_linear(x, b + "ffn_norm.weight", b + "ffn_gate_up.weight")
                x = gemv.silu_down_gemv(gu, self.w[wd], self.types[wd], *self.nk[wd], residual=x)
            else:
                h = loop.rmsnorm(x, self.g16[b + "ffn_norm.weight"], c.eps)
                if self.fused:  # a prompt: the gate+up matrix, then SwiGLU over its [gate | up] rows
                    gate_up = self._linear(h, b + "ffn_gate_up.weight")
                else:
                    gate_up = mx.concatenate([self._linear(h, b + f"ffn_{n}.weight") for n in ("gate", "up")],
                                             axis=-1)
                x = x + self._linear(loop.swiglu(gate_up), wd)
        out = "token_embd.weight" if c.tied else "output.weight"
        return self._norm_linear(x, "output_norm.weight", out)

    def _seamed_layers(self, x: mx.array, t: int, pos, attend) -> mx.array:
        """layers() for a decode token (t <= FUSED_UP_TO) with the seams: layer 0's QKV on its
        own, then per layer attention and two seams, the last of which makes the logits."""
        c = self.config
        out = "token_embd.weight" if c.tied else "output.weight"
        h = self._qkv(0, x)
        for i in range(c.n_layers):
            b, after = f"blk.{i}.", f"blk.{i + 1}."
            o = attend(i, x, t, pos, h)
            x, gate_up = self._seam(i, False, o, x, b + "ffn_norm.weight", b + "ffn_gate_up.weight")
            last = i + 1 == c.n_layers
            x, h = self._seam(i, True, gate_up, x, "output_norm.weight" if last else after + "attn_norm.weight",
                              out if last else after + "attn_qkv.weight")
        return h
