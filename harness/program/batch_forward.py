"""One forward for a whole batch of sequences over the paged pool: the model that continuous
batching (harness.program.serve) calls each step.

A step's work is a few sequences, each with its tokens to run (a new prompt's uncached part, or
the last token) from its own position, and its block table into one pool of KV rows. The forward
runs every token of every sequence through each matrix at once (one [T, d] matmul a projection,
T the step's tokens), and splits the batch only where a token must see its own sequence: RoPE at
its positions, the K/V rows written at its slots (block * block_size + offset), and attention
over the rows its table names, causal within its new tokens.

`PagedBatchReference` does this with MLX built-ins: the reference variant's plan and weights
(harness.program.decode.ReferenceDecoder), replayed with the three batch-aware steps swapped in.
It runs anywhere MLX runs, the CPU included, so the batching itself (tables, slots, copies,
preemption) is tested in CI against each sequence decoded alone.

Pipelined (option `serve_pipelined`), a step's greedy tokens stay on the device: the forward
returns them as DeviceTokens, queues the step (mx.async_eval) and reads the step before it, so the
host builds step n + 1 while the GPU runs step n, as the decode loop's compiled-pipelined mode
does. The scheduler needs no token's value to go on (a sequence ends by its count); the pool
hashes a filled block's tokens when it publishes the block, by then read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from harness.program.decode import _OPS, ReferenceDecoder, _heads
from harness.program.kv_pool import KVPool
from harness.program.serve import Work
from kernels import options


class StepTokens:
    """A step's greedy tokens (int32 [len(work)], its argmax) while they are on the device: read
    to the host once, by the first that asks; from argmax's host words where the step has them
    (option serve_token_words), so that the device array itself is never read by the host."""

    def __init__(self, picked: mx.array, words: tuple[mx.array, ...] = ()):
        self.array, self.words, self._values = picked, words, None

    def values(self) -> list[int]:
        if self._values is None:
            if self.words:
                from kernels.loop import tokens_from_words

                self._values = tokens_from_words(self.words, self.array.shape[0])
            else:
                self._values = np.array(self.array).tolist()
        return self._values


class DeviceToken:
    """A sequence's token of a StepTokens, standing for the int it will be: int() (and hash, ==,
    which read it) waits for its step; the next decode step takes it on the device instead."""

    __slots__ = ("step", "row")

    def __init__(self, step: StepTokens, row: int):
        self.step, self.row = step, row

    def __int__(self) -> int:
        return self.step.values()[self.row]

    __index__ = __int__

    def __hash__(self) -> int:
        return hash(int(self))

    def __eq__(self, other) -> bool:
        if isinstance(other, (int, np.integer, DeviceToken)):
            return int(self) == int(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"DeviceToken({int(self)})"


class _Tokens:
    """A batched forward's greedy tokens, {request id: token}: ints read after the step, or
    (option serve_pipelined) DeviceTokens with the step queued and the one before it read, so
    that one step is in flight while the host builds the next. `lag`: steps between a step and
    the read of its tokens (serve_bench times a token from then)."""

    _in_flight: StepTokens | None = None
    # where set (harness.tools.serve_profile), seconds summed over steps: 'encode', queuing a
    # step (mx.async_eval: MLX encodes its kernels on the host); 'wait', reading tokens
    timings: dict[str, float] | None = None

    @property
    def lag(self) -> int:
        return int(options.get("serve_pipelined"))

    def _tokens(self, work: list[Work], picked: mx.array, words: tuple[mx.array, ...] = ()) -> dict:
        began = time.perf_counter()
        mx.async_eval(picked, *words)
        encoded = time.perf_counter()
        if not options.get("serve_pipelined"):
            tokens = {w.request.id: t for w, t in zip(work, StepTokens(picked, words).values())}
        else:
            if self._in_flight is not None:
                self._in_flight.values()  # the step before, while this one runs: one step ahead at most
            self._in_flight = StepTokens(picked, words)
            tokens = {w.request.id: DeviceToken(self._in_flight, row) for row, w in enumerate(work)}
        if self.timings is not None:
            self.timings["encode"] = self.timings.get("encode", 0.0) + encoded - began
            self.timings["wait"] = self.timings.get("wait", 0.0) + time.perf_counter() - encoded
        return tokens


def host_tokens(tokens: list) -> list[int]:
    """Token ids for the host (a prompt's, or DeviceTokens read)."""
    return [int(t) for t in tokens]


def slots_of(w: Work, block_size: int, start: int = 0) -> np.ndarray:
    """int32 pool rows (block * block_size + offset) of positions start..w.start+len(w.tokens)-1
    through w's table; refused where the table is too short for its tokens."""
    end = w.start + len(w.tokens)
    if not w.tokens or len(w.table) * block_size < end:
        raise ValueError(f"request {w.request.id!r}: {len(w.tokens)} tokens at {w.start} with "
                         f"{len(w.table)} blocks of {block_size}")
    pos = np.arange(start, end)
    return (np.asarray(w.table, np.int64)[pos // block_size] * block_size + pos % block_size).astype(np.int32)


def views(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[mx.array]:
    """Arrays of `shapes`, one after another in `flat`, as views of one MLX array made from it."""
    whole, at, out = mx.array(flat), 0, []
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(whole[at:at + size].reshape(shape))
        at += size
    return out


def decode_slots(work: list[Work], table: np.ndarray, starts: np.ndarray, block_size: int) -> np.ndarray:
    """slots_of for a step of one token a sequence, from the step's table (int32 [len(work),
    width], a row a sequence) and their positions: a few array operations where slots_of's loop
    over 64 sequences took about 0.3 ms of the host's step. Refused where a table is too short."""
    held = np.fromiter((len(w.table) for w in work), np.int64, len(work))
    short = np.flatnonzero(held * block_size <= starts)
    if short.size:
        w = work[short[0]]
        raise ValueError(f"request {w.request.id!r}: 1 token at {w.start} with {len(w.table)} blocks of {block_size}")
    return (table[np.arange(len(work)), starts // block_size].astype(np.int64) * block_size
            + starts % block_size).astype(np.int32)


@dataclass
class Segment:
    """A sequence's tokens in the step's batch: rows at..at+n of it, positions start..start+n-1."""

    at: int
    n: int
    start: int
    slots: np.ndarray  # int32 pool rows of positions 0..start+n-1 (the table, unrolled)


class PagedBatchReference(_Tokens):
    """The reference variant's forward over a batch of sequences and a paged KV pool of
    `pool.num_blocks` blocks of `pool.block_size` rows a layer ([blocks * block_size, n_kv, D])."""

    variant = "reference"

    def __init__(self, decoder: ReferenceDecoder, pool: KVPool):
        c = decoder.config
        self.decoder, self.pool = decoder, pool
        rows = pool.num_blocks * pool.block_size
        self.k = [mx.zeros((rows, c.n_kv_heads, c.head_dim), decoder.dtype) for _ in range(c.n_layers)]
        self.v = [mx.zeros((rows, c.n_kv_heads, c.head_dim), decoder.dtype) for _ in range(c.n_layers)]
        self.ops = dict(_OPS, rope=self._rope, kv_write=self._kv_write, attention=self._attention)
        self._segments: list[Segment] = []

    def __call__(self, work: list[Work]) -> dict:
        """Each sequence's next token (greedy) after running its tokens: {request id: token}."""
        return self._tokens(work, mx.argmax(self.forward(work), axis=-1).astype(mx.int32))

    def forward(self, work: list[Work]) -> mx.array:
        """The logits of each sequence's last token, [len(work), vocab] float32, in work's order."""
        if not work:
            raise ValueError("a step needs at least one sequence")
        bs = self.pool.block_size
        for w in work:  # copy-on-write first: the rows a shared block held, into the sequence's own
            for src, dst in w.copies:
                for cache in (self.k, self.v):
                    for i in range(len(cache)):
                        cache[i][dst * bs:(dst + 1) * bs] = cache[i][src * bs:(src + 1) * bs]
        tokens, self._segments = [], []
        for w in work:
            self._segments.append(Segment(len(tokens), len(w.tokens), w.start, slots_of(w, bs)))
            tokens += w.tokens
        env = {"token": mx.array(np.asarray(host_tokens(tokens), np.int32))}
        d, t = self.decoder, len(tokens)
        for step in d.plan:
            self.ops[step.op](d, step, env, t, None, None)
        last = mx.array(np.array([s.at + s.n - 1 for s in self._segments], np.int32))
        return env["logits"][last]

    # ---- the steps that see a sequence's own positions and rows -----------------------------------
    def _rope(self, d, s, env, t, offset, store):
        parts = []
        for seg in self._segments:
            part = {s.reads[0]: env[s.reads[0]][seg.at:seg.at + seg.n]}
            _OPS["rope"](d, s, part, seg.n, seg.start, None)
            parts.append(part[s.writes[0]])
        env[s.writes[0]] = mx.concatenate(parts, axis=2)  # [1, heads, T, D]

    def _kv_write(self, d, s, env, t, offset, store):
        c, i = d.config, s.layer
        new = mx.array(np.concatenate([seg.slots[seg.start:] for seg in self._segments]))
        self.k[i][new] = env["k"][0].transpose(1, 0, 2)
        self.v[i][new] = _heads(env["v"], c.n_kv_heads, t, c.head_dim)[0].transpose(1, 0, 2)
        env[s.writes[0]] = i

    def _attention(self, d, s, env, t, offset, store):
        i, window = env[s.reads[1]], d.config.layer(s.layer).window
        outs = []
        for seg in self._segments:
            rows = mx.array(seg.slots)
            keys = self.k[i][rows].transpose(1, 0, 2)[None]  # [1, n_kv, start + n, D]
            values = self.v[i][rows].transpose(1, 0, 2)[None]
            held = mx.arange(seg.start + seg.n)
            queries = (seg.start + mx.arange(seg.n))[:, None]
            mask = held[None, :] <= queries if seg.n > 1 else None
            if window:
                near = queries - held[None, :] < window
                mask = near if mask is None else mask & near
            part = {"q": env["q"][:, :, seg.at:seg.at + seg.n], s.reads[1]: (keys, values, mask)}
            _OPS["attention"](d, s, part, seg.n, None, None)
            outs.append(part["o"])
        env["o"] = mx.concatenate(outs, axis=0)  # [T, heads * D]


class PagedBatchKernels(_Tokens):
    """lathe's kernel variants (unfused, fused) over a batch of sequences and the paged pool: the
    decoder's paged plan for the step's T tokens (its phase: the fused GEMVs up to 4 rows, the
    quantized GEMM or MLX's matmul past that), every projection over all T rows in one launch,
    with the position-dependent steps swapped for the batch's: RoPE of q and k at each token's
    position with the K/V rows written at their slots (rope_paged_kv_write, one launch), the
    decode tokens' attention in one paged_attention launch over their tables and lengths, and
    each prompt's in a prefill_attention launch over its table.
    The pool's blocks are the caches' blocks (vLLM's layouts, blocks of BLOCK_SIZE rows)."""

    def __init__(self, model, variant: str, pool: KVPool, max_seq: int):
        from harness.program import kernel_decode as kd

        if pool.block_size != kd.BLOCK_SIZE:
            raise ValueError(f"the kernel variants' pool has blocks of {kd.BLOCK_SIZE} rows, got {pool.block_size}")
        self.kd, self.pool = kd, pool
        self.mega = variant == "megafused"
        if self.mega:
            self._check_mega(model)
        # megafused: fused's decoder (its plan runs the prompts), its weights stacked for token_block
        self.d = kd.KernelDecoder(model, max_seq, "fused" if self.mega else variant, "paged")
        self.variant = self.d.label
        if self.mega:
            self._stack_for_mega()
        c = model.config
        k_shape = (pool.num_blocks, c.n_kv_heads, c.head_dim // 8, pool.block_size, 8)
        v_shape = (pool.num_blocks, c.n_kv_heads, c.head_dim, pool.block_size)
        self.d.k = [mx.full(k_shape, float("nan"), mx.float16) for _ in range(c.n_layers)]
        self.d.v = [mx.full(v_shape, float("nan"), mx.float16) for _ in range(c.n_layers)]
        self._step: dict = {}
        # megafused: a list that gets each decode step's token_block launches' BlockTimelines
        # (harness.tools.block_timeline --batch; such steps are not compiled), or None
        self.timeline: list | None = None
        self.max_blocks = -(-max_seq // pool.block_size)
        # decode-only steps, by (batch, table width, serve_cache_outputs)
        self._compiled: dict[tuple[int, int, bool], object] = {}
        # serve_device_inputs: the last decode step's (starts, table) on the host and its input arrays
        self._last_inputs: tuple | None = None
        self._advance = None  # serve_device_inputs: the compiled launch that advances them (made once)

    def _check_mega(self, model) -> None:
        """The megafused batch variant runs the layers token_block's batch form takes: the llama /
        qwen3 / qwen2 layer, one block type a projection's [q; k; v] (no V apart), over CUDA's
        one launch; anything else is refused here, by name, before any weight is moved."""
        from kernels import backends

        kd, c = self.kd, model.config
        types = {n: t.lower() for n, t in model.types.items()}
        why = kd.kernel_gaps(c, model.types, "megafused") or []
        why += [w for w in [kd.mega_types(c, types)] if w]
        a = c.architecture
        why += [what for what, present in (
            ("Gemma's post-block norms and float32 stream", a.post_norms or a.embed_scale),
            ("sliding-window layers", any(c.layer(i).window for i in range(c.n_layers))),
            ("V rows of another block type than Q and K's", kd.split_v_apart(c, types)),
            ("fused attn_qkv / ffn_up tensors", a.fused_qkv or a.fused_gate_up),
            ("no waits between threadgroups on this GPU (Metal)", not backends.cross_group_waits())) if present]
        if why:
            raise ValueError(f"the megafused batch variant does not run this {c.arch} model's {'; '.join(why)}: "
                             f"the fused variant does (--variant fused)")

    def _stack_for_mega(self) -> None:
        """token_block's stacks of fused's repacked matrices (their views kept for the prompts'
        plan: no second copy), the biases stacked, and merge counters for serve_mega_rows sequences."""
        from kernels import blocks

        d, c = self.d, self.d.config
        d._stack_layers()
        if c.biases:
            d.stacks.qkv_bias = mx.stack(d.bias)
            mx.eval(d.stacks.qkv_bias)
        self.variant = "megafused/paged"
        # sequences a token_block launch takes (serve_mega_rows): more go in launches of as many
        self.mega_rows = options.get("serve_mega_rows")
        if not 1 <= self.mega_rows <= blocks.BATCH_ROWS:
            raise ValueError(f"serve_mega_rows must be 1..{blocks.BATCH_ROWS} (token_block's batch form), "
                             f"got {self.mega_rows}")
        # a queue and merge counters for each launch of a step: nothing orders a step's launches
        # (their sequences' rows are apart; MLX may run them at once), so none may share them
        self._mega_sites: list[tuple[mx.array, mx.array]] = []

    def _mega_site(self, i: int) -> tuple[mx.array, mx.array]:
        """The queue and merge counters of a step's i-th token_block launch, made once: the i-th
        launches of successive steps may share them, being ordered by the tokens each step reads."""
        from kernels import attention, blocks

        c = self.d.config
        while len(self._mega_sites) <= i:
            self._mega_sites.append((blocks.block_queue(5 * c.n_layers),
                                     attention.merge_counters(c.n_heads * self.mega_rows)))
        return self._mega_sites[i]

    def runs_mega(self, t: int) -> bool:
        """Whether a decode-only step of t sequences runs token_block's batch form (megafused,
        up to serve_mega_up_to of them, while the products the other t - 1 add stay within
        serve_mega_extra), not the plan's layers."""
        if not self.mega or t > options.get("serve_mega_up_to"):
            return False
        return (t - 1) * self.d.stacks.values <= options.get("serve_mega_extra") * 1_000_000

    def __call__(self, work: list[Work]) -> dict:
        loop, logits = self.kd.loop, self.forward(work)
        if options.get("serve_token_words") and len(work) <= loop.ARGMAX_HOST_ROWS:
            return self._tokens(work, *loop.argmax(logits, host_words=True))  # every row's, one launch
        return self._tokens(work, loop.argmax(logits))

    def forward(self, work: list[Work]) -> mx.array:
        """The logits of each sequence's last token, [len(work), vocab], in work's order."""
        d, bs = self.d, self.pool.block_size
        if not work:
            raise ValueError("a step needs at least one sequence")
        stamped = self.timeline is not None  # a stamped step is built eagerly (its launches are the compiled one's)
        if options.get("serve_compiled") and not stamped and all(len(w.tokens) == 1 and not w.copies for w in work):
            return self._decode_step(work)
        for w in work:  # copy-on-write first: the whole block, every layer
            for src, dst in w.copies:
                for i in range(len(d.k)):
                    d.k[i][dst] = d.k[i][src]
                    d.v[i][dst] = d.v[i][src]
        tokens, positions, slots, ends, decode, prefill = [], [], [], [], [], []
        for w in work:
            slots.append(slots_of(w, bs, w.start))
            at = len(tokens)
            (decode if len(w.tokens) == 1 else prefill).append((at, w))
            tokens += w.tokens
            positions += range(w.start, w.start + len(w.tokens))
            ends.append(len(tokens) - 1)
        t = len(tokens)
        self._check_tables(work)
        table = self._table([w for _, w in decode], max([len(w.table) for _, w in decode] + [1]))
        # attention's outputs come as the decode tokens' rows, then each prompt's: `order` puts
        # them back in token order (one gather a layer, not a slice a sequence)
        grouped = [at for at, _ in decode] + [at + j for at, w in prefill for j in range(len(w.tokens))]
        self._step = dict(positions=mx.array(np.asarray(positions, np.int32)),
                          slots=mx.array(np.concatenate(slots)), ends=mx.array(np.asarray(ends, np.int32)),
                          decode=decode, prefill=prefill, table=mx.array(table),
                          lens=mx.array(np.asarray([w.start + 1 for _, w in decode], np.int32)), t=t,
                          decode_rows=mx.array(np.asarray([at for at, _ in decode], np.int32)),
                          order=mx.array(np.argsort(np.asarray(grouped)).astype(np.int32)))
        mx.eval(d.k, d.v)  # host tokens: nothing orders this step after the last one's in-place writes
        env = {"token": host_tokens(tokens)}
        if not prefill and self.runs_mega(t):  # decode tokens here: a copy on write, or serve_compiled off
            logits = self._mega_replay(env, t, self._step["positions"], self._step["table"])["logits"]
        else:
            logits = self._replay(env, t)["logits"]
        return logits if logits.shape[0] == len(work) else logits[self._step["ends"]]

    def _decode_step(self, work: list[Work]) -> mx.array:
        """A step of decode tokens only, through an mx.compile'd function of (ids, positions,
        slots, table, lens, *k caches, *v caches), traced once per (batch, table width) and
        replayed after, as the single-sequence decoder's compiled step: an eager step spent
        about 15 ms building its graph in Python at a12307b (Qwen3-0.6B, 8 sequences; 228
        launches), more than its kernels take. The table's width is rounded up to a power of
        two blocks (its unused entries 0; the kernels clamp each length to its own blocks), so
        growing sequences retrace once per doubling."""
        d, bs, n = self.d, self.pool.block_size, self.d.config.n_layers
        widest = max(len(w.table) for w in work)
        if widest > self.max_blocks:
            raise ValueError(f"a block table of {widest} blocks is past the {self.max_blocks} of max_seq")
        table = self._table(work, min(self.max_blocks, 1 << (widest - 1).bit_length()))
        if table.min() < 0 or table.max() >= self.pool.num_blocks:  # (its padding is block 0)
            raise ValueError(f"a block table points outside the pool's {self.pool.num_blocks} blocks")
        outputs = options.get("serve_cache_outputs")
        key = (*table.shape, outputs)
        fn = self._compiled.get(key)
        if fn is None:
            if len(self._compiled) >= 16:  # each holds its traced graph
                self._compiled.pop(next(iter(self._compiled)))
            fn = self._compiled[key] = mx.compile(self._decode_over_caches(len(work), outputs))
        starts = np.fromiter((w.start for w in work), np.int32, len(work))
        slots = decode_slots(work, table, starts, bs)
        ids = self._ids_on_device(work)
        if ids is None:  # host tokens: nothing orders this step after the last one's in-place writes
            ids = np.asarray(host_tokens([w.tokens[0] for w in work]), np.int32)
            mx.eval(d.k, d.v)
        host = [starts, slots, table, starts + 1] + ([ids] if isinstance(ids, np.ndarray) else [])
        carried = self._advanced(starts, table) if options.get("serve_device_inputs") else None
        if carried is not None:  # this step's inputs from the last one's, on the device: no host write
            made = carried + [mx.array(ids)] if isinstance(ids, np.ndarray) else carried
        elif options.get("serve_token_words"):
            # the step's host-made arrays as views of one: a buffer the host writes is of another
            # size class than the step's token array (4 bytes a row), which MLX's cache would
            # otherwise hand to argmax's output with its page still on the host (argmax.metal)
            made = views(np.concatenate([a.reshape(-1) for a in host]), [a.shape for a in host])
        else:
            made = [mx.array(a) for a in host]
        if isinstance(ids, np.ndarray):
            ids = made.pop()
        self._last_inputs = (starts, table, made) if options.get("serve_device_inputs") else None
        logits, *caches = fn(ids, *made, *d.k, *d.v)
        if caches:
            d.k, d.v = list(caches[:n]), list(caches[n:])
        return logits

    def _advanced(self, starts: np.ndarray, table: np.ndarray) -> list[mx.array] | None:
        """serve_device_inputs: the step's (positions, slots, table, lengths) made on the device from
        the last decode step's, where the same sequences each moved on one token over the same block
        tables (a block a sequence is added every block_size steps: then the host's), so that the
        step writes no host memory. None where they cannot be. The host's own values (decode_slots)
        are still computed and checked above; these are the same by construction."""
        last = self._last_inputs
        if last is None:
            return None
        last_starts, last_table, arrays = last
        if not np.array_equal(last_starts + 1, starts) or not np.array_equal(last_table, table):  # (shapes too)
            return None
        if self._advance is None:
            bs = self.pool.block_size

            def advance(positions: mx.array, table: mx.array):
                positions = positions + 1
                block = mx.take_along_axis(table, (positions // bs)[:, None], axis=1)[:, 0]
                return positions, block * bs + positions % bs, positions + 1

            self._advance = mx.compile(advance)
        positions, slots, lens = self._advance(arrays[0], arrays[2])
        return [positions, slots, arrays[2], lens]

    @staticmethod
    def _ids_on_device(work: list[Work]) -> mx.array | None:
        """The step's ids as rows of one earlier step's argmax, still on the device, where every
        sequence's token is a DeviceToken of that step (pipelined): ordered after that step's
        cache writes by its data, as the decode loop's compiled-pipelined step. None otherwise."""
        first = work[0].tokens[0]
        if not isinstance(first, DeviceToken):
            return None
        step, rows = first.step, []
        for w in work:
            t = w.tokens[0]
            if not isinstance(t, DeviceToken) or t.step is not step:
                return None
            rows.append(t.row)
        if rows == list(range(step.array.shape[0])):
            return step.array
        return step.array[mx.array(np.asarray(rows, np.int32))]

    def _check_tables(self, work: list[Work]) -> None:
        """Every table entry of the step inside the pool: checked here once for every layer, then
        given to the kernels as device arrays (their host checks would repeat a loop over the
        batch in each layer)."""
        held = np.concatenate([np.asarray(w.table) for w in work])
        if held.min() < 0 or held.max() >= self.pool.num_blocks:
            raise ValueError(f"a block table points outside the pool's {self.pool.num_blocks} blocks")

    @staticmethod
    def _table(work: list[Work], width: int) -> np.ndarray:
        """The sequences' block tables as int32 [len(work), width], 0 past each one's own blocks
        (the kernels clamp each length to its own blocks)."""
        table = np.zeros((len(work), width), np.int32)
        for row, w in enumerate(work):
            table[row, :len(w.table)] = w.table
        return table

    def _decode_over_caches(self, batch: int, cache_outputs: bool = True):
        """A decode-only step's forward as a function of its arrays for mx.compile, the caches
        inputs (and outputs, with `cache_outputs`) rather than state the trace would capture.
        Without them as outputs the kernels still write the pools in place; the next step reads
        them after this one's writes because MLX runs one stream in order and the next step's
        ids come from this step's tokens (or are read on the host after it)."""
        d, n = self.d, self.d.config.n_layers

        def over(ids, positions, slots, table, lens, *caches):
            held = d.k, d.v, self._step
            d.k, d.v = list(caches[:n]), list(caches[n:])
            self._step = dict(positions=positions, slots=slots, table=table, lens=lens, t=batch, prefill=[],
                              decode=[(row, None) for row in range(batch)], decode_rows=None, order=None,
                              ends=mx.arange(batch, dtype=mx.int32))
            try:
                if self.runs_mega(batch):
                    logits = self._mega_replay({"token": ids}, batch, positions, table)["logits"]
                else:
                    logits = self._replay({"token": ids}, batch)["logits"]
                return (logits, *d.k, *d.v) if cache_outputs else (logits,)
            finally:
                d.k, d.v, self._step = held

        return over

    def _mega_replay(self, env: dict, t: int, positions: mx.array, table: mx.array) -> dict:
        """A decode-only step on the megafused variant: the plan's embedding and head as fused's,
        every layer of t sequences' tokens in token_block's batch form, a launch a mega_rows of
        them (each launch reads every weight once; the caches order one after the last, unless
        serve_mega_together runs them at once)."""
        from kernels import blocks
        from kernels.runtime import depends

        d, c, layers_done = self.d, self.d.config, False
        starts = range(0, t, self.mega_rows)
        # serve_mega_together: the launches take the caches as the step found them and split the
        # GPU between them, so that they run at once; else each takes the last one's caches (and
        # the whole GPU), and they run one after another
        together = len(starts) > 1 and options.get("serve_mega_together")
        for step in self.d.plan_for(t):
            if step.layer is None:
                swap = self._swaps.get(step.op)
                step.run(self.d, env, t, 0) if swap is None else swap(self, step, env)
            elif not layers_done:
                x, outs, k, v = env["x"], [], d.k, d.v
                for launch_, at in enumerate(starts):
                    rows = slice(at, min(t, at + self.mega_rows))
                    queue, counters = self._mega_site(launch_)
                    out, k_out, v_out = blocks.token_block(
                        x[rows], d.stacks, c.eps, d.stacks.w_qkv.qtypes[0], k, v, positions[rows],
                        n_heads=c.n_heads, theta=c.rope_theta, neox=c.neox, queue=queue, counters=counters,
                        layer_kind=d.layer_kind, inv_freqs=d.stacked_inv_freqs, scale=d.scale, table=table[rows],
                        share=len(starts) if together else 1, timeline=self.timeline)
                    if not together:
                        k, v = k_out, v_out
                    outs.append(out)
                if together:  # the pools written by every launch (in place): ordered after all of them
                    k, v = depends(k, outs), depends(v, outs)
                d.k, d.v = k, v
                env["x"] = outs[0] if len(outs) == 1 else mx.concatenate(outs)
                layers_done = True
        return env

    def _replay(self, env: dict, t: int) -> dict:
        """The decoder's plan for t tokens, its position-dependent steps swapped for the batch's."""
        for step in self.d.plan_for(t):
            swap = self._swaps.get(step.op)
            if swap is None:
                step.run(self.d, env, t, 0)
            else:
                swap(self, step, env)
        return env

    # ---- the steps that see a token's own position and rows ----------------------------------------
    def _rope(self, step, env):
        """RoPE and the K/V write as one launch: q rotated, K rotated and V copied into the pool at
        each token's slot (rope_paged_kv_write). The unfused plan's RoPE of q runs it; its RoPE
        of k and its write are then done; the fused plan has it as one step."""
        if step.reads[0] not in ("q", "qkv"):
            return
        d, i, st = self.d, step.layer, self._step
        norms = self.kd._head_norms(d, i) if step.op == "rope_kv_write" else {}
        if (not st["prefill"] and "qkv" in env and "q" not in env and step.op == "rope_kv_write"
                and options.get("serve_rope_attention")):
            env["rope_in_attention"] = norms  # a decode-only step: _attention's launch does it
            return
        self.kd.paged_rope_kv_write(d, i, env, st["t"], st["positions"], st["slots"], norms)

    def _kv_write(self, step, env):
        pass  # written with RoPE (_rope)

    def _attention(self, step, env):
        d, i, st = self.d, step.layer, self._step
        attention = self.kd.attention
        norms = env.pop("rope_in_attention", None)
        if norms is not None:  # every token a sequence's next: RoPE, K/V write and attention, one launch
            o, d.k[i], d.v[i] = attention.paged_rope_attention(
                env["qkv"], d.k[i], d.v[i], st["table"], st["positions"], d.scale, n_heads=d.config.n_heads,
                theta=d.thetas[i], inv_freq=d.inv_freqs[i], neox=d.config.neox, window=d.windows[i],
                softcap=d.config.attn_softcap, split_from=options.get("serve_split_from"), **norms)
            self.kd._end_layer_attention(env, o.reshape(st["t"], -1))
            return
        q = env["q"]
        parts = []  # the decode tokens' rows, then each prompt's, put back in token order below
        if st["decode"]:
            parts.append(attention.paged_attention(q[st["decode_rows"]] if st["prefill"] else q, d.k[i], d.v[i],
                                                   st["table"], st["lens"], d.scale, after=env["written"],
                                                   window=d.windows[i], softcap=d.config.attn_softcap,
                                                   split_from=options.get("serve_split_from")))
        for at, w in st["prefill"]:
            parts.append(attention.prefill_attention(q[at:at + len(w.tokens)], d.k[i], d.v[i], w.start, d.scale,
                                                     block_table=w.table, after=env["written"], window=d.windows[i],
                                                     softcap=d.config.attn_softcap))
        o = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)[st["order"]]
        self.kd._end_layer_attention(env, o.reshape(st["t"], -1))

    def _last_rows(self, step, env):
        env["x"] = env["x"][self._step["ends"]]

    _swaps = {"rope": _rope, "rope_kv_write": _rope, "kv_write": _kv_write, "attention": _attention,
              "last_row": _last_rows}


BATCH_VARIANTS = ("reference", "unfused", "fused", "megafused")


def make_batch_forward(model, variant: str, pool: KVPool, max_seq: int):
    """The batched forward of a variant over `pool` (sequences up to max_seq tokens): MLX
    built-ins (reference), or lathe's kernels one per op (unfused), fused, or megafused (a GPU:
    a decode-only step's layers in token_block launches of up to serve_mega_rows sequences, prompts
    on fused's plan)."""
    if variant not in BATCH_VARIANTS:
        raise ValueError(f"variant {variant!r} has no batched forward (these do: {', '.join(BATCH_VARIANTS)})")
    if variant == "reference":
        return PagedBatchReference(ReferenceDecoder(model, max_seq), pool)
    return PagedBatchKernels(model, variant, pool, max_seq)
