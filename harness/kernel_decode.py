"""The decode loop's kernel variants (device-verified on the H200: tests/test_kernel_decode.py).

- `unfused`: one of lathe's kernels per op: embedding, RMSNorm, the Q4_0/Q8_0 GEMV (`linear`),
  RoPE + KV write (in place), flash decode, SwiGLU; residual adds are MLX adds.
- `fused`: RMSNorm folded into one QKV GEMV and one gate+up GEMV over concatenated matrices,
  Qwen3's head norms folded into the RoPE + KV write, SiLU folded into the down GEMV, the final
  norm into the output GEMV.

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

from harness.decode import Step
from harness.models import Model

VARIANTS = ("unfused", "fused")
FUSED_UP_TO = 4  # rows of X the fused RMSNorm+GEMV takes (kernels.gemv.MAX_M)


def kernel_plan(c, fused: bool) -> list[Step]:
    """The steps each token replays (one dispatch each, MLX adds included)."""
    gemv = "lathe gemv_v2 (Q4_0/Q8_0)"
    steps = [Step("embed", "lathe embed", ("token",), ("x",), ("token_embd.weight",), ("token",))]
    for i in range(c.n_layers):
        b = f"blk.{i}."
        if fused:
            steps += [Step("rmsnorm_linear", "lathe rmsnorm_gemv", ("x",), ("qkv",),
                           (b + "attn_norm.weight", b + "attn_qkv (q|k|v)"), layer=i)]
            rope = "lathe head_norm_rope_neox_qkv_write" if c.head_norm else "lathe rope_qkv_write"
            steps += [Step("rope_kv_write", rope, ("qkv",), ("q", f"cache.{i}"),
                           (b + "attn_q_norm.weight", b + "attn_k_norm.weight") if c.head_norm else (),
                           ("pos",), layer=i)]
        else:
            steps += [Step("rms_norm", "lathe rmsnorm", ("x",), ("h",), (b + "attn_norm.weight",), layer=i)]
            steps += [Step("linear", gemv, ("h",), (n,), (b + f"attn_{n}.weight",), layer=i) for n in "qkv"]
            if c.head_norm:
                steps += [Step("head_norm", "lathe head_rmsnorm", (n,), (n,), (b + f"attn_{n}_norm.weight",),
                               layer=i) for n in "qk"]
            steps += [Step("rope_kv_write", "lathe rope_batch_kv_write", ("q", "k", "v"), ("q", f"cache.{i}"),
                           (), ("pos",), layer=i)]
        steps += [Step("attention", "lathe flash_decode / prefill_attention (+ combine past 2048)",
                       ("q", f"cache.{i}"), ("o",), (), ("kv_len",), layer=i)]
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
    if fused:
        steps += [Step("rmsnorm_linear", "lathe rmsnorm_gemv", ("x",), ("logits",), ("output_norm.weight", out))]
    else:
        steps += [Step("rms_norm", "lathe rmsnorm", ("x",), ("h",), ("output_norm.weight",)),
                  Step("linear", gemv, ("h",), ("logits",), (out,))]
    return steps


class KernelDecoder:
    """Prefill and decode with lathe's kernels over a loaded GGUF model (see the module doc)."""

    def __init__(self, model: Model, max_seq: int, variant: str = "fused") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        c = model.config
        if max_seq < 1 or max_seq > c.ctx:
            raise ValueError(f"max_seq must be in 1..{c.ctx} (the model's context), got {max_seq}")
        self.config, self.max_seq, self.variant = c, max_seq, variant
        self.fused = variant == "fused"
        self.types = {n: t.lower() for n, t in model.types.items()}
        self.w, self.nk = {}, {}
        for name, t in model.tensors.items():
            if name.endswith("norm.weight"):
                continue
            if t.dtype == np.uint8:
                bb = 18 if self.types[name] == "q4_0" else 34
                self.w[name] = mx.array(t)
                self.nk[name] = (t.shape[0], t.shape[1] // bb * 32)
            else:
                self.w[name] = mx.array(np.asarray(t, dtype=np.float16))
                self.nk[name] = tuple(t.shape)
        norms = [n for n in model.tensors if n.endswith("norm.weight")]
        self.g16 = {n: mx.array(np.asarray(model.tensors[n], dtype=np.float16)) for n in norms}
        self.g32 = {n: mx.array(np.asarray(model.tensors[n], dtype=np.float32)) for n in norms}
        if self.fused:
            self._concat("attn_qkv", ("attn_q", "attn_k", "attn_v"))
            self._concat("ffn_gate_up", ("ffn_gate", "ffn_up"))
        self.plan = kernel_plan(c, self.fused)
        self._compiled = None
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

    def reset(self) -> None:
        c = self.config
        shape = (c.n_kv_heads, self.max_seq, c.head_dim)
        self.k = [mx.zeros(shape, mx.float16) for _ in range(c.n_layers)]
        self.v = [mx.zeros(shape, mx.float16) for _ in range(c.n_layers)]
        self.pos = 0

    # -- ops --------------------------------------------------------------------------------------
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
        if self.pos + t > self.max_seq:
            raise ValueError(f"{self.pos + t} tokens do not fit the cache of {self.max_seq}")
        logits = self.layers(ids, t, self.pos)
        self.pos += t
        return logits

    def compiled_step(self):
        """One decode step as an mx.compile'd function of (token, pos, *k caches, *v caches) ->
        (logits, *k caches, *v caches), traced once per decoder: the position is an int32[1]
        array, so the RoPE + KV write and attention read it on the device, and attention's grid
        is sized for max_seq (kernels.attention.flash_decode). Host work per token is one call."""
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

            compiled = mx.compile(step)

            def run(token, pos, *caches):
                # The caches must be evaluated before the call: on the H200, a first (tracing) call
                # whose caches were still being written by a lazy prompt graph read stale rows
                # now and then. Evaluating arrays that are already evaluated costs nothing.
                mx.eval(caches)
                return compiled(token, pos, *caches)

            self._compiled = run
        return self._compiled

    def layers(self, ids, t: int, pos) -> mx.array:
        """The model over t tokens at positions pos.. (an int; an int32[1] array in a compiled
        step), K and V written into self.k / self.v in place."""
        from kernels import attention, gemv, loop, rope

        c = self.config
        hd = c.head_dim
        embd = "token_embd.weight"
        x = loop.embed(self.w[embd], ids, self.types[embd] if self.types[embd] != "f32" else "f16", c.d_model)
        write = rope.rope_neox_batch_kv_write if c.neox else rope.rope_batch_kv_write
        scale = 1.0 / math.sqrt(hd)
        for i in range(c.n_layers):
            b = f"blk.{i}."
            if self.fused:  # RoPE (and Qwen3's head norms) read Q, K, V in place in the QKV output
                qkv = self._norm_linear(x, b + "attn_norm.weight", b + "attn_qkv.weight")
                if c.head_norm:
                    rot = rope.head_norm_rope_neox_qkv_write(
                        qkv, self.g32[b + "attn_q_norm.weight"], self.g32[b + "attn_k_norm.weight"],
                        self.k[i], self.v[i], pos, n_heads=c.n_heads, eps=c.eps, theta=c.rope_theta)
                else:
                    rot = rope.rope_qkv_write(qkv, self.k[i], self.v[i], pos, n_heads=c.n_heads,
                                              theta=c.rope_theta, neox=c.neox)
            else:
                h = loop.rmsnorm(x, self.g16[b + "attn_norm.weight"], c.eps)
                q, k, v = (self._linear(h, b + f"attn_{n}.weight") for n in "qkv")
                if c.head_norm:
                    q = rope.head_rmsnorm(q.reshape(t, c.n_heads, hd), self.g32[b + "attn_q_norm.weight"], c.eps)
                    k = rope.head_rmsnorm(k.reshape(t, c.n_kv_heads, hd), self.g32[b + "attn_k_norm.weight"], c.eps)
                rot = write(q, k, v, self.k[i], self.v[i], pos, theta=c.rope_theta)
            self.k[i], self.v[i] = rot.k_cache, rot.v_cache
            if t == 1:
                lens = [pos + 1] if isinstance(pos, int) else pos + 1
                o = attention.flash_decode(rot.q.reshape(1, c.n_heads, hd), self.k[i][None], self.v[i][None],
                                           lens, scale, after=rot.written)
            else:  # a prompt: causal, each token over the cache up to its own position
                o = attention.prefill_attention(rot.q.reshape(t, c.n_heads, hd), self.k[i], self.v[i],
                                                pos, scale, after=rot.written)
            wo, wd = b + "attn_output.weight", b + "ffn_down.weight"
            if self.fused and t <= FUSED_UP_TO and self.types[wo] in ("q4_0", "q8_0"):
                x = gemv.gemv_v2(o.reshape(t, -1), self.w[wo], self.types[wo], *self.nk[wo], residual=x)
            else:
                x = x + self._linear(o.reshape(t, -1), wo)
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
        return self._norm_linear(x, "output_norm.weight", out).astype(mx.float32)
