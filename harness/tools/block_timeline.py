"""Inside a megafused token: token_block's own record of its tickets, phase by phase.

    python -m harness.tools.block_timeline qwen3-0.6b --qtype q8_0
    python -m harness.tools.block_timeline llama3-8b --qtype q4_0 --depth 4096 --tokens 5 --png gantt.png
    python -m harness.tools.block_timeline llama3-8b --set block_prefetch=off --raw stamps.npz
    python -m harness.tools.block_timeline qwen3-0.6b --batch 8 --depth 128   # serve's step of 8

A megafused token is one launch (kernels.blocks.token_block): CUPTI sees one kernel and Nsight
Compute one set of counters, so neither says where inside it the time goes. With a timeline, thread
0 of each ticket stamps it three times as it runs (layer_block.metal's TIMELINE): when it was
claimed, when its wait for the phase before was over, and when its outputs were written (just
before its signal). Each stamp holds the GPU's %globaltimer (ns, one clock for all SMs, which on
some GPUs moves only every microsecond), the SM's %clock (cycles, fine, but each SM its own) and
the SM; `align` puts every stamp on one nanosecond axis: the timer itself where it is fine, else
each SM's cycles fitted to the timer's nanoseconds.

Each phase of the token (a layer's QKV, ATTN, O, UP, DOWN) then gives:
- span: its last ticket done less the last of the phase before: its share of the token (the spans
  add up to the launch);
- lag: its first ticket let go less the last done before it: the signal's way from the last
  producer to the first consumer (an atomic to the L2, a poll, a barrier);
- start: its median ticket let go less the last done before it: the lag, and for a ticket claimed
  after the phase before was done, its threadgroup's way from its last done to this claim;
- body: its last done less its first let go: the phase's own time once it may start;
- tail: its last done less its median done: how long the slowest tickets run past the typical one;
- work and wait: a ticket's time from let go to done, and from claimed to let go (medians).
By kind, the medians over layers and tokens, and the GEMV phases' weights over their span (GB/s,
% of the copy peak measured in the same process). With `--set block_timeline_marks=on`, three
more stamps inside an attention ticket (decode_rows.metal's marks) split its work: `query` (let go
to its query ready: the head norm, RoPE and the new K/V row), `scores` (to its first chunk's
scores: K's loads and the products), `chunks` (to its last chunk's P.V: the softmax, P.V and any
later chunks) and `out` (to done: the SIMD groups' sums, the output and, split, the partials'
merge), medians over its tickets; the marks lie on the attention phase's path and slow it (Qwen3's
token about 7% at depth 0). The rows go to results/<device>/timeline.csv;
`--png` draws the tickets by SM over time (the whole token and its first layers).

The tokens are decoded uncompiled (the step mode, whose launches are the compiled ones'), after a
prompt of `depth` + 16 tokens and a few tokens of warm-up. `--batch N` stamps `lathe serve
--variant megafused`'s decode step instead: N sequences, each after its own prompt, through
token_block's batch form over the paged pool (one launch a step; rows with `sequences` N).

The stamps are code of their own: they change the kernel's registers, and where that crosses an
occupancy step the stamped launch runs apart from the plain one (8 SIMD groups in the batch form:
stamped 1426 us, 1300 by its stamps, plain 1558; kernels/loop/NOTES.md). So each set also runs
`--tokens` steps without them under the kernel trace (CUPTI, where there is one): the plain
module's GPU time, printed beside the stamps' and in the token row's `gpu_us`. Take an A/B from
that column. The stamped tokens run under the trace too, which prints how much of the stamped
launch lies outside its stamps, and each threadgroup's own stamps (its start, the end of its
claims, its exit) say where: before the first claim, after the last ticket's stamp, or outside
the threadgroups altogether (the launch's own start and end, as CUPTI sees them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

KIND_NAMES = ("QKV", "ATTN", "O", "UP", "DOWN")  # kernels.blocks' phase kinds, in their order
FINE_NS = 100  # a timer moving in steps of at most this many ns is used as it is (no cycle fit)


def _signed(values: np.ndarray, origin) -> np.ndarray:
    """uint32 values less `origin`, as signed int64 (32-bit counters that may wrap once)."""
    d = (values.astype(np.int64) - np.int64(origin)) % (1 << 32)
    return np.where(d >= 1 << 31, d - (1 << 32), d)


def timer_step(ns: np.ndarray) -> float:
    """The smallest step between distinct readings of the timer: its resolution, as seen."""
    steps = np.diff(np.unique(ns))
    return float(steps.min()) if steps.size else 0.0


def launch_edges(tickets: np.ndarray, groups: np.ndarray) -> dict[str, float]:
    """What of a launch lies outside its tickets' stamps, by the threadgroups' own (us, on the
    global timer): `before`, its first threadgroup's start to its first claim; `after`, its last
    ticket's last stamp to its last threadgroup's exit; `starts`, the first threadgroup's start to
    the last one's (all resident: about nothing); `groups`, the first start to the last exit (the
    threadgroups' whole life). tickets [rows, S, 3] and groups [groups, 3, 3] uint32
    (BlockTimeline.array, group_stamps); empty where the launch has no group rows."""
    if groups.size == 0:
        return {}
    origin = tickets[0, 0, 0]
    t = _signed(tickets[:, :, 0], origin)
    g = _signed(groups[:, :, 0], origin)
    return {"before": (t[:, 0].min() - g[:, 0].min()) / 1e3, "after": (g[:, 2].max() - t.max()) / 1e3,
            "starts": float(np.ptp(g[:, 0])) / 1e3, "groups": (g[:, 2].max() - g[:, 0].min()) / 1e3}


# The stamps of a row in the order they are taken (kernels.blocks.TIMELINE_STAMPS): claimed, let
# go, the attention's three marks inside, done
IN_TIME = (0, 1, 3, 4, 5, 2)
INSIDE = ("query", "scores", "chunks", "out")  # the intervals between IN_TIME's stamps from let go


def align(stamps: np.ndarray) -> tuple[np.ndarray, dict]:
    """Stamps uint32 [rows, S, 3] (BlockTimeline; S = 3, or 6 with the attention's marks inside)
    -> (ns [rows, S] float64 from the first ticket's claim, info). Where the global timer moves in steps of at most FINE_NS it is used as it is;
    else each SM's cycles are fitted to the timer's readings (least squares, ns = a + b cycles, the
    timer's floor taken as the middle of its step), which keeps the cycles' resolution on the
    timer's common axis. info: the timer's step, how the stamps were aligned, the fit's residual."""
    stamps = np.asarray(stamps)
    if stamps.ndim != 3 or stamps.shape[1] not in (3, len(IN_TIME)) or stamps.shape[2] != 3:
        raise ValueError(f"stamps must be [tickets, 3 or {len(IN_TIME)}, 3], got {stamps.shape}")
    ns = _signed(stamps[:, :, 0], stamps[0, 0, 0]).astype(np.float64)
    step = timer_step(ns)
    info = {"timer_step_ns": step, "aligned_by": "globaltimer", "fit_rms_ns": 0.0}
    if step <= FINE_NS:
        return ns - ns.min(), info
    out = np.empty_like(ns)
    sms = stamps[:, 0, 2]
    residuals = []
    for sm in np.unique(sms):
        rows = sms == sm
        cycles = _signed(stamps[rows, :, 1], stamps[rows, 0, 1][0]).astype(np.float64)
        x, y = cycles.ravel(), ns[rows].ravel() + step / 2
        if np.ptp(x) == 0:
            out[rows] = ns[rows] + step / 2
            continue
        b, a = np.polyfit(x, y, 1)
        out[rows] = a + b * cycles
        residuals.append(y - (a + b * x))
    info.update(aligned_by="cycles fitted to the timer, per SM",
                fit_rms_ns=float(np.sqrt(np.mean(np.concatenate(residuals) ** 2))) if residuals else 0.0)
    return out - out.min(), info


def phase_rows(tickets) -> list[slice]:
    """Each phase's rows of the stamps: the claimed phases' tickets in claim order (phase order),
    then the last phase's groups (layer_block.metal's stamp_row)."""
    edges = np.concatenate([[0], np.cumsum(tickets)])
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def phase_table(ns: np.ndarray, kinds, tickets) -> list[dict]:
    """A row a phase (module doc): kind, layer, tickets and the times in us."""
    if len(kinds) != len(tickets) or sum(tickets) != ns.shape[0]:
        raise ValueError(f"{sum(tickets)} tickets for {ns.shape[0]} stamped rows")
    first = kinds[0]
    out, before = [], float(ns[:, 0].min())  # the first phase's "phase before": the launch's first claim
    for j, (kind, rows) in enumerate(zip(kinds, phase_rows(tickets))):
        claimed, let_go, done = ns[rows, 0], ns[rows, 1], ns[rows, 2]
        last = float(done.max())
        out.append(dict(phase=j, kind=KIND_NAMES[kind], layer=(first + j) // 5, tickets=int(claimed.size),
                        span_us=(last - before) / 1e3, lag_us=(float(let_go.min()) - before) / 1e3,
                        body_us=(last - float(let_go.min())) / 1e3, tail_us=(last - float(np.median(done))) / 1e3,
                        start_us=(float(np.median(let_go)) - before) / 1e3,
                        work_us=float(np.median(done - let_go)) / 1e3,
                        wait_us=float(np.median(let_go - claimed)) / 1e3, end_us=last / 1e3))
        before = last
    return out


def attention_inside(ns: np.ndarray, kinds, tickets) -> dict[str, np.ndarray]:
    """Each attention ticket's work split at its marks (INSIDE's intervals, ns), over every
    attention phase of the launch; empty where the stamps have no marks."""
    if ns.shape[1] < len(IN_TIME):
        return {}
    rows = [r for kind, r in zip(kinds, phase_rows(tickets)) if KIND_NAMES[kind] == "ATTN"]
    at = np.concatenate([ns[r] for r in rows]) if rows else np.zeros((0, ns.shape[1]))
    ordered = at[:, list(IN_TIME)]
    return {name: ordered[:, i + 2] - ordered[:, i + 1] for i, name in enumerate(INSIDE)}


def by_kind(phases: list[dict], bytes_of: dict[str, float], peak_gbs: float | None) -> list[dict]:
    """Each kind's medians over its phases (all layers, all tokens), its share of the tokens'
    time, and its bytes (a layer's weights; ATTN: the KV read) over its median span."""
    total = sum(p["span_us"] for p in phases)
    out = []
    for kind in KIND_NAMES:
        mine = [p for p in phases if p["kind"] == kind]
        if not mine:
            continue
        spans = np.array([p["span_us"] for p in mine])
        row = {key: float(np.median([p[key] for p in mine]))
               for key in ("span_us", "lag_us", "start_us", "body_us", "tail_us", "work_us", "wait_us")}
        row.update(kind=kind, phases=len(mine), tickets=int(np.median([p["tickets"] for p in mine])),
                   span_min_us=float(spans.min()), span_max_us=float(spans.max()), share=float(spans.sum() / total))
        nbytes = bytes_of.get(kind)
        row["bytes"] = nbytes
        row["gbs"] = nbytes / (row["span_us"] * 1e3) if nbytes else None
        row["pct_peak"] = 100 * row["gbs"] / peak_gbs if row["gbs"] and peak_gbs else None
        out.append(row)
    return out


def lags_a_token(kinds: list[dict], tokens: int) -> float:
    """The phases' lags of one token, added up (us): what the signals between phases cost it."""
    return sum(k["lag_us"] * k["phases"] for k in kinds) / max(1, tokens)


def print_summary(title: str, kinds: list[dict], token_us: list[float], info: dict,
                  inside: dict[str, np.ndarray] | None = None) -> None:
    print(f"{title}: token_block {np.median(token_us):.1f} us a token (median of {len(token_us)}); stamps "
          f"aligned by {info['aligned_by']} (timer step {info['timer_step_ns']:.0f} ns, fit rms "
          f"{info['fit_rms_ns']:.0f} ns)")
    print(f"  {'kind':5s} {'span':>7s} {'lag':>6s} {'start':>6s} {'body':>7s} {'tail':>6s} {'work':>7s} {'wait':>7s} "
          f"{'share':>6s} {'tickets':>7s} {'GB/s':>7s} {'%peak':>6s}   (us, medians over phases)")
    for k in kinds:
        gbs = f"{k['gbs']:7.0f}" if k["gbs"] else f"{'':7s}"
        pct = f"{k['pct_peak']:6.1f}" if k["pct_peak"] else f"{'':6s}"
        print(f"  {k['kind']:5s} {k['span_us']:7.2f} {k['lag_us']:6.2f} {k['start_us']:6.2f} {k['body_us']:7.2f} "
              f"{k['tail_us']:6.2f} {k['work_us']:7.2f} {k['wait_us']:7.2f} {100 * k['share']:5.1f}% "
              f"{k['tickets']:7d} {gbs} {pct}")
    lag = lags_a_token(kinds, len(token_us))
    print(f"  lags add up to {lag:.1f} us a token ({100 * lag / np.median(token_us):.1f}%)")
    if inside and all(v.size for v in inside.values()):
        print("  ATTN inside (us, medians over its tickets): "
              + ", ".join(f"{name} {np.median(v) / 1e3:.2f}" for name, v in inside.items()))


def gantt(ns: np.ndarray, stamps: np.ndarray, kinds, tickets, path: Path, title: str, layers: int = 2) -> Path:
    """Each ticket a bar on its SM's line from let go to done (a thin grey one from claimed to let
    go), coloured by kind: the whole token above, its first `layers` layers below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"QKV": "tab:blue", "ATTN": "tab:orange", "O": "tab:green", "UP": "tab:red", "DOWN": "tab:purple"}
    sm = stamps[:, 0, 2].astype(int)
    fig, axes = plt.subplots(2, 1, figsize=(14, 9))
    rows = phase_rows(tickets)
    cut = rows[min(len(rows), 5 * layers) - 1].stop
    for ax, upto in zip(axes, (ns.shape[0], cut)):
        for kind, sl in zip(kinds, rows):
            if sl.start >= upto:
                break
            t, s = ns[sl] / 1e3, sm[sl]
            ax.hlines(s, t[:, 0], t[:, 1], colors="0.8", linewidth=0.6)
            ax.hlines(s, t[:, 1], t[:, 2], colors=colours[KIND_NAMES[kind]], linewidth=1.6)
        ax.set_xlabel("us from the launch's first claim")
        ax.set_ylabel("SM")
    axes[0].set_title(f"{title}: token_block's tickets (grey: claimed, waiting; colour: running)")
    axes[1].set_title(f"its first {layers} layers")
    axes[0].legend(handles=[plt.Line2D([], [], color=c, label=k) for k, c in colours.items()], loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kind_bytes(decoder, position: int, sequences: int = 1) -> dict[str, float]:
    """A layer's bytes of each phase kind (the mean over layers): the GEMVs' weights (read once
    for all the launch's sequences), ATTN's K and V read at `position` by each sequence."""
    s, c = decoder.stacks, decoder.config
    mean = lambda stack: float(np.mean([stack.layer(i).data.nbytes for i in range(stack.layers)]))  # noqa: E731
    qkv = mean(s.w_qkv) + (mean(s.w_v) if s.w_v is not None else 0.0)
    return {"QKV": qkv, "O": mean(s.w_o), "UP": mean(s.w_gate_up), "DOWN": mean(s.w_down),
            "ATTN": 2.0 * c.n_kv_heads * c.head_dim * 2 * (position + 1) * sequences}


class _Steps:
    """What run() stamps: `decoder` (its stacks and config), `pos`, step(), and `timeline`, the
    list that `_stamped` (the object whose token_block launches are stamped) appends each
    launch's BlockTimeline to, or None."""

    _stamped: object

    @property
    def timeline(self) -> list | None:
        return self._stamped.timeline

    @timeline.setter
    def timeline(self, value: list | None) -> None:
        self._stamped.timeline = value


class BatchSteps(_Steps):
    """`batch` sequences decoded together as `lathe serve --variant megafused` decodes them: the
    megafused batch forward (token_block's batch form over one paged pool, a launch a step for up
    to serve_mega_rows sequences), each sequence after its own prompt of `prompt` random tokens
    (prefilled alone, on fused's plan). step() runs one decode step of all of them, built eagerly
    (a stamped step is not compiled; its launches are the compiled step's), and waits for it;
    `timeline` is the forward's (a list gets each launch's BlockTimeline)."""

    def __init__(self, model, batch: int, prompt: int, max_seq: int, seed: int = 0):
        import mlx.core as mx

        from harness.program.batch_forward import PagedBatchKernels
        from harness.program.kernel_decode import BLOCK_SIZE
        from harness.program.kv_pool import KVPool
        from harness.program.serve import Request, Work
        from kernels import options

        if not 1 <= batch <= options.get("serve_mega_rows"):
            raise ValueError(f"a stamped batch step is one token_block launch: 1..serve_mega_rows "
                             f"({options.get('serve_mega_rows')}) sequences, got {batch}")
        self.pool = KVPool(num_blocks=batch * -(-max_seq // BLOCK_SIZE), block_size=BLOCK_SIZE)
        self.forward = PagedBatchKernels(model, "megafused", self.pool, max_seq)
        if not self.forward.runs_mega(batch):  # else the steps run fused's plan: nothing to stamp
            raise ValueError(f"serve's megafused step of {batch} {model.config.arch} sequences runs fused's plan, "
                             f"not token_block: past serve_mega_up_to ({options.get('serve_mega_up_to')}) or "
                             f"serve_mega_extra ({options.get('serve_mega_extra')} million products; this model "
                             f"adds {self.forward.d.stacks.values / 1e6:.0f} a sequence); --set either higher")
        self.decoder, self._stamped = self.forward.d, self.forward
        rng = np.random.default_rng(seed)
        self.requests, self.last = [], []
        for i in range(batch):
            tokens = [int(t) for t in rng.integers(0, model.config.vocab, prompt)]
            placed = self.pool.add(i, tokens)
            request = Request(i, tokens, max_seq)
            logits = self.forward.forward([Work(request, tokens[placed.prefilled:], placed.prefilled, placed.table,
                                                placed.copies, prefill=True)])
            self.requests.append(request)
            self.last.append(int(np.array(mx.argmax(logits[0]))))

    @property
    def pos(self) -> int:
        """The tokens cached a sequence (each has as many)."""
        return self.pool.length(self.requests[0].id)

    def step(self) -> None:
        import mlx.core as mx

        from harness.program.serve import Work
        from kernels import options

        work = []
        for request, token in zip(self.requests, self.last):
            start = self.pool.length(request.id)
            placed = self.pool.append(request.id, token)
            work.append(Work(request, [token], start, placed.table, placed.copies))
        with options.use(serve_compiled=False):
            picked = mx.argmax(self.forward.forward(work), axis=-1)
        self.last = [int(t) for t in np.array(picked).tolist()]


class OneSequence(_Steps):
    """One sequence decoded by the megafused decoder over the contiguous cache (token_block's
    launch a token, uncompiled: the step mode), after a prompt of `prompt` random tokens; step()
    decodes a token and waits for it; `timeline` is the decoder's."""

    def __init__(self, model, prompt: int, max_seq: int, seed: int = 0):
        from harness.program.decode import make_decoder

        self.decoder = self._stamped = make_decoder(model, max_seq, "megafused")
        if self.decoder.span != "token":
            raise SystemExit("block_timeline reads token_block's launch: mega_span=token (the default)")
        tokens = np.random.default_rng(seed).integers(0, model.config.vocab, prompt)
        self.token = self.decoder.greedy(self.decoder.forward(tokens))

    @property
    def pos(self) -> int:
        return self.decoder.pos

    def step(self) -> None:
        import mlx.core as mx

        self.token = self.decoder.greedy(self.decoder.forward(self.token))
        mx.eval(self.token)


def run(preset: str, qtype: str, depth: int, tokens: int, raw: Path | None, png: Path | None,
        write: bool, settings: list[dict] | None = None, rounds: int = 1, batch: int = 0) -> list[dict]:
    """Stamp `tokens` decode tokens under each of `settings` (option sets, default: the options
    as they are), in `rounds` alternated rounds on one decoder; print each one's summary and the
    token's time side by side, and write their rows. `batch`: that many sequences decoded together
    as serve's megafused step (BatchSteps: token_block's batch form over the paged pool), each
    after its own prompt; 0: one sequence over the contiguous cache (OneSequence)."""
    from harness.peak import measure_peak
    from harness.program.decode import model_file
    from harness.program.models import load_gguf
    from harness.results import append_rows, results_dir, run_metadata
    from harness.tools import gpu_trace
    from kernels import options, runtime

    runtime.require_gpu()
    settings = settings or [{}]
    model = load_gguf(model_file(preset, qtype))
    c = model.config
    max_seq = depth + 16 + rounds * len(settings) * (2 * tokens + 3) + 8
    seqs = BatchSteps(model, batch, depth + 16, max_seq) if batch else OneSequence(model, depth + 16, max_seq)
    decoder = seqs.decoder
    peak = measure_peak().gbs
    # Every stamped launch's arrays are held to the end: once the host has read a buffer, MLX's
    # allocator may hand it to a later launch, whose first writes then wait on the pages' way back
    # to the GPU (managed memory). Stamped again, such tokens showed phases of 50-250 us.
    rows, times, held = [], {}, []
    for round_ in range(1, rounds + 1):
        for i, opts in enumerate(settings):
            with options.use(**opts):
                for _ in range(2):  # warm-up: compiles and first uses
                    seqs.step()
                seqs.timeline = []
                with gpu_trace.kernel_trace() as traced:  # (empty without a kernel trace)
                    for _ in range(tokens):
                        seqs.step()
                timelines, seqs.timeline = seqs.timeline, None
                stamped_gpu = _token_block_us(traced)
                if not timelines:
                    raise SystemExit("no token_block launch was stamped")
                held += timelines
                phases, token_us, info, kept, inside, edges = [], [], None, {}, {}, []
                for j, tl in enumerate(timelines):
                    stamps = tl.array()
                    edges.append(launch_edges(stamps, tl.group_stamps()))
                    ns, info = align(stamps)
                    for name, v in attention_inside(ns, tl.kinds, tl.tickets).items():
                        inside[name] = np.concatenate([inside.get(name, np.zeros(0)), v])
                    table = phase_table(ns, tl.kinds, tl.tickets)
                    phases += table
                    token_us.append(table[-1]["end_us"])
                    kept[f"stamps_{j}"] = stamps
                kinds = by_kind(phases, _kind_bytes(decoder, seqs.pos - tokens // 2, max(batch, 1)), peak)
                gpu_us = plain_gpu_us(seqs, tokens)
                label = options.describe(opts) or "defaults"
                title = f"{preset} {qtype} d{depth}{f' x{batch} sequences' if batch else ''}, {label}, round {round_}"
                print_summary(title, kinds, token_us, info, inside)
                if gpu_us is not None:
                    print(f"  the plain module (as decode and serve launch it), GPU time: {gpu_us:.1f} us a step "
                          f"(CUPTI, median of {tokens})")
                if stamped_gpu:  # what the stamps cannot see: the launch before its first claim, after its last stamp
                    launch_us = float(np.median(stamped_gpu))
                    print(f"  the stamped launch, GPU time: {launch_us:.1f} us, "
                          f"{outside_stamps(stamped_gpu, token_us):.1f} us of it outside its stamps")
                if edges and edges[0]:  # where that lies, by the threadgroups' own stamps
                    med = {k: float(np.median([e[k] for e in edges])) for k in edges[0]}
                    print(f"  its threadgroups: the first started {med['before']:.1f} us before the first claim, "
                          f"the last left {med['after']:.1f} us after the last ticket's stamp, "
                          f"their starts spread over {med['starts']:.1f} us (medians)")
                    if stamped_gpu:  # CUPTI's launch against the threadgroups' life, launch by launch
                        print(f"  the launch outside its threadgroups' life (before the first starts, after the "
                              f"last leaves): {outside_stamps(stamped_gpu, [e['groups'] for e in edges]):.1f} us")
                times.setdefault(label, []).append((float(np.median(token_us)), gpu_us))
                tag = f"-{i}" if len(settings) > 1 else ""
                if raw and round_ == 1:
                    path = raw.with_name(f"{raw.stem}{tag}{raw.suffix}")
                    np.savez_compressed(path, kinds=np.array(timelines[0].kinds),
                                        tickets=np.array(timelines[0].tickets), **kept)
                    print(f"wrote {path}")
                if png and round_ == 1:
                    path = png.with_name(f"{png.stem}{tag}{png.suffix}")
                    ns, _ = align(kept["stamps_0"])
                    print(f"wrote {gantt(ns, kept['stamps_0'], timelines[0].kinds, timelines[0].tickets, path, title)}")
                rows += _rows(kinds, token_us, timelines[0], c, peak, preset, qtype, depth, run_metadata(), round_,
                              batch, gpu_us)
    if len(settings) > 1 or rounds > 1:
        print(f"{preset} {qtype} d{depth}{f' x{batch} sequences' if batch else ''}: token_block us a step "
              f"(median of {tokens}; stamps, and the plain module's GPU time), by round:")
        for label, ts in times.items():
            print(f"  {label:60s} " + " ".join(f"{t:8.1f} {'-' if g is None else f'{g:.1f}':>8}" for t, g in ts))
    if write:
        path = append_rows(results_dir(Path(__file__).resolve().parents[2], runtime.device_name()) / "timeline.csv",
                           "timeline", rows)
        print(f"wrote {path}")
    return rows


def outside_stamps(launch_us: list[float], stamped_us: list[float]) -> float:
    """The stamped launches' GPU time outside a span of their own stamps (us, a median), launch by
    launch where the trace holds each one (both lists in launch order); the medians' difference
    otherwise (a launch missing from the trace)."""
    if len(launch_us) == len(stamped_us):
        return float(np.median(np.subtract(launch_us, stamped_us)))
    return float(np.median(launch_us) - np.median(stamped_us))


def plain_gpu_us(seqs: _Steps, tokens: int) -> float | None:
    """The token_block launches' GPU time (CUPTI; median us) over `tokens` more steps without the
    stamps: the module decode and serve run. The stamps change the code, and so the registers: at
    8 SIMD groups the batch form's stamped module took 128 (2 threadgroups an SM) and the plain one
    130 (1), 1426 against 1558 us a step, while the stamps said 1300 (kernels/loop/NOTES.md). None
    where there is no kernel trace (harness.tools.gpu_trace)."""
    from harness.tools import gpu_trace

    if not gpu_trace.available():
        return None
    seqs.timeline = None
    seqs.step()  # the plain module's compile and first use, outside the trace
    with gpu_trace.kernel_trace() as kernels:
        for _ in range(tokens):
            seqs.step()
    times = _token_block_us(kernels)
    return float(np.median(times)) if times else None


def _token_block_us(kernels: list) -> list[float]:
    """The durations (us) of the token_block launches among a kernel trace's (start, us, name)."""
    return [duration for _, duration, name in kernels if "token_block" in name]


def _rows(kinds: list[dict], token_us: list[float], timeline, config, peak: float, preset: str, qtype: str,
          depth: int, meta: dict, round_: int, batch: int = 0, gpu_us: float | None = None) -> list[dict]:
    """timeline.csv's rows of one stamped run: a kind each, and the token's (batch: the step's of
    that many sequences, variant megafused/paged), whose gpu_us is the plain module's (plain_gpu_us)."""
    from kernels import runtime

    weights = sum(k["bytes"] for k in kinds if k["kind"] != "ATTN") * config.n_layers
    common = dict(benchmark="block-timeline", kernel="token_block", variant="megafused/paged" if batch else "megafused",
                  backend=runtime.backend(), device=runtime.device_name(), peak_gbs=peak, model=preset,
                  qtype=qtype, depth=depth, layers=config.n_layers, repeats=len(token_us), round=round_,
                  sequences=batch or None, **meta)
    rows = [dict(common, us=k["span_us"], us_min=k["span_min_us"], us_max=k["span_max_us"], gbs=k["gbs"],
                 pct_peak=k["pct_peak"], bytes=k["bytes"], phase=k["kind"], tickets=k["tickets"],
                 lag_us=k["lag_us"], start_us=k["start_us"], body_us=k["body_us"], tail_us=k["tail_us"],
                 work_us=k["work_us"], wait_us=k["wait_us"], share=k["share"]) for k in kinds]
    tok = float(np.median(token_us))
    rows.append(dict(common, us=tok, us_min=min(token_us), us_max=max(token_us), gbs=weights / (tok * 1e3),
                     pct_peak=100 * weights / (tok * 1e3) / peak, bytes=weights, phase="token",
                     tickets=sum(timeline.tickets), share=1.0, gpu_us=gpu_us,
                     lag_us=lags_a_token(kinds, len(token_us)),
                     start_us=None, body_us=None, tail_us=None, work_us=None, wait_us=None))
    return rows


def main(argv: list[str] | None = None) -> int:
    from kernels import options

    p = argparse.ArgumentParser(prog="python -m harness.tools.block_timeline", description=__doc__.split("\n")[0])
    p.add_argument("preset", help="a preset (decode's), a real model or a GGUF file")
    p.add_argument("--qtype", default="q8_0")
    p.add_argument("--depth", type=int, default=0, help="tokens in the cache before the 16-token prompt")
    p.add_argument("--tokens", type=int, default=5, help="stamped decode tokens")
    p.add_argument("--raw", type=Path, help="the stamps of every token, as .npz")
    p.add_argument("--png", type=Path, help="the tickets by SM over time")
    p.add_argument("--no-write", action="store_true", help="print only (no timeline.csv rows)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE[,...]",
                   help="experiment options (`lathe options`), recorded in the rows")
    p.add_argument("--ab", action="append", default=[], metavar="NAME=VALUE[,...]",
                   help="an option set to stamp beside the others (give it more than once; '' for --set's "
                        "alone), alternated over --rounds on one decoder")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--batch", type=int, default=0,
                   help="sequences decoded together as lathe serve's megafused step (token_block's batch form "
                        "over the paged pool, one launch: up to serve_mega_rows), each after its own prompt of "
                        "--depth + 16 tokens; 0: one sequence over the contiguous cache")
    args = p.parse_args(argv)
    settings = [options.parse(text) for text in args.ab] or None
    with options.use(**options.parse(",".join(args.set))):
        run(args.preset, args.qtype, args.depth, args.tokens, args.raw, args.png, not args.no_write, settings,
            args.rounds, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
