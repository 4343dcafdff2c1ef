"""`lathe serve`: many sequences at once through continuous batching (harness.program.serve) over
one paged pool, timed the way llama.cpp's llama-batched-bench times its batches.

A workload is `batch` requests of `prompt` tokens each (random ids; the first `shared` tokens the
same in all, a system prompt the pool stores once) that generate `gen` tokens each. All arrive at
once, as llama-batched-bench's do: the first steps prefill the prompts, the rest decode a token of
every sequence a step. `mixed` draws each request's prompt and generation lengths from [half, all]
and spreads the arrivals over the first steps, so sequences start and stop at their own steps.

Per run (one row of results/<device>/serve.csv):
- tok_s: generated tokens over the whole run's time; decode_tok_s: tokens of the steps that only
  decode over those steps' time (llama-batched-bench's S_TG; pipelined, not the step right after
  a prompt's, whose window holds that prompt's GPU time); prefill_tok_s: prompt tokens
  computed over the time of the steps that ran any (its S_PP);
- time to first token (from a request's arrival step to the end of the step that gave its first
  token) and time per output token (its later tokens' time over their count), median and p99;
- the pool's occupancy (share of its blocks held), the most and the mean over the steps;
- megafused: the share of its decode-only steps that ran token_block's batch form (mega_steps; the
  others ran fused's plan: serve_mega_up_to, serve_mega_extra).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from harness.program.kv_pool import KVPool
from harness.program.serve import Request, Scheduler, Work
from kernels import options

BLOCK_SIZE = 16  # rows a block of the pool (vLLM's default, as the kernel variants' paged cache)


@dataclass(frozen=True)
class Workload:
    batch: int
    prompt: int
    gen: int
    shared: int = 0
    mixed: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.batch < 1 or self.prompt < 1 or self.gen < 1:
            raise ValueError(f"batch, prompt and gen must be at least 1, got {self.batch}, {self.prompt}, {self.gen}")
        if not 0 <= self.shared < self.prompt:
            raise ValueError(f"shared must be in 0..prompt-1 (a prompt keeps a token of its own), got {self.shared}")

    def requests(self, vocab: int) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        system = [int(t) for t in rng.integers(0, vocab, self.shared)]
        reqs = []
        for i in range(self.batch):
            n, gen, arrival = self.prompt, self.gen, 0
            if self.mixed:
                n = int(rng.integers(max(self.shared + 1, (self.prompt + 1) // 2), self.prompt + 1))
                gen = int(rng.integers((self.gen + 1) // 2, self.gen + 1))
                arrival = int(rng.integers(0, max(1, self.gen // 2)))
            own = [int(t) for t in rng.integers(0, vocab, n - self.shared)]
            reqs.append(Request(i, system + own, max_new=gen, arrival=arrival))
        return reqs

    def pool(self, block_size: int = BLOCK_SIZE) -> KVPool:
        """A pool that holds every sequence at its longest at once (no preemption), as
        llama-batched-bench's context holds its batch."""
        return KVPool(self.batch * -(-(self.prompt + self.gen) // block_size), block_size)


@dataclass
class Served:
    """What a run measured (seconds, tokens), before it becomes a row."""

    requests: list[Request]
    steps: list[tuple[float, float, int, int, bool]]  # (start, end, prompt tokens run, tokens run, decode only)
    occupancy: list[float]
    lag: int = 0  # a step's tokens are read at the end of the step `lag` steps later (pipelined: 1)
    mega: list[bool] | None = None  # megafused: whether each decode-only step ran token_block's batch form

    def summary(self) -> dict:
        t0 = self.steps[0][0]
        ends = [end for _, end, *_ in self.steps]
        starts = [start for start, *_ in self.steps]
        generated = sum(len(r.output) for r in self.requests)
        # a step's window ends with the read of the tokens `lag` steps back, whose GPU time it then
        # holds: decode-only, it counts where those steps were decode-only too (not a prompt's)
        decode = [(end - start, tokens) for i, (start, end, _, tokens, only) in enumerate(self.steps)
                  if only and all(step[4] for step in self.steps[max(0, i - self.lag):i])]
        prefill = [(end - start, p) for start, end, p, _, _ in self.steps if p]
        def known(step: int) -> float:  # when the host has the tokens of step `step` (from 1)
            return ends[min(step - 1 + self.lag, len(ends) - 1)]

        ttft = [known(r.first_token_step) - starts[min(r.arrival, len(starts) - 1)] for r in self.requests]
        tpot = [(known(r.finished_step) - known(r.first_token_step)) / (len(r.output) - 1)
                for r in self.requests if len(r.output) > 1]
        pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else None  # noqa: E731 - ms
        return dict(
            seconds=ends[-1] - t0, generated=generated, steps=len(self.steps),
            tok_s=generated / (ends[-1] - t0),
            decode_tok_s=sum(n for _, n in decode) / sum(s for s, _ in decode) if decode else None,
            prefill_tok_s=sum(n for _, n in prefill) / sum(s for s, _ in prefill) if prefill else None,
            ttft_ms_median=pct(ttft, 50), ttft_ms_p99=pct(ttft, 99),
            tpot_ms_median=pct(tpot, 50), tpot_ms_p99=pct(tpot, 99),
            occupancy_max=max(self.occupancy), occupancy_mean=float(np.mean(self.occupancy)),
            preempted=sum(r.preempted for r in self.requests),
            mega_steps=float(np.mean(self.mega)) if self.mega else None)


def serve(forward, pool: KVPool, requests: list[Request], max_batch: int) -> Served:
    """Run the requests to the end through `forward` (a batch's next tokens, {id: token}), timing
    every step. A pipelined forward (its `lag` 1) returns with its step queued and the one before
    read, so a step's time is the host's and the GPU's overlapped; the last step ends when every
    token is read."""
    sched = Scheduler(pool, max_batch)
    for r in requests:
        sched.submit(r)
    steps, occupancy = [], []
    runs_mega = forward.runs_mega if getattr(forward, "mega", False) else None
    mega = [] if runs_mega else None  # megafused: each decode-only step's plan
    while not sched.idle():
        start = time.perf_counter()
        work: list[Work] = sched.step(forward)
        end = time.perf_counter()
        prompt = sum(len(w.tokens) for w in work if w.prefill)
        steps.append((start, end, prompt, sum(len(w.tokens) for w in work), bool(work) and not prompt))
        occupancy.append(pool.occupancy())
        if runs_mega and steps[-1][4]:
            mega.append(runs_mega(len(work)))
    sched.settle()
    if steps:
        start, _, *rest = steps[-1]
        steps[-1] = (start, time.perf_counter(), *rest)
    return Served(requests, steps, occupancy, getattr(forward, "lag", 0), mega)


# ---- a run of the matrix: rows of serve.csv ----------------------------------------------------------
def serve_row(common: dict, summary: dict) -> dict:
    """A results/<device>/serve.csv row: us is a decode-only step's mean time."""
    steps = summary.get("decode_tok_s")
    us = 1e6 * common["batch"] / steps if steps else None
    return dict(common, benchmark="serve", us=None if us is None else round(us, 1), gbs=None, pct_peak=None,
                bytes=None, steps=summary.get("steps"),
                **{k: (None if summary.get(k) is None else round(float(summary[k]), 3)) for k in (
                    "tok_s", "decode_tok_s", "prefill_tok_s", "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median",
                    "tpot_ms_p99", "occupancy_max", "occupancy_mean", "mega_steps")},
                preempted=summary.get("preempted"))


def peer_row(common: dict, test: dict, build: str) -> dict:
    """llama-batched-bench's result for one batch size as a serve.csv row (variant llama.cpp)."""
    return serve_row(dict(common, variant="llama.cpp", peer_build=build),
                     dict(tok_s=test["speed"], decode_tok_s=test["speed_tg"], prefill_tok_s=test["speed_pp"]))


def pair_with_peer(rows: list[dict]) -> list[dict]:
    """Each lathe row's x_llama_cpp: its decode tok/s over llama.cpp's at the same batch size and
    round of the run."""
    peers = {(r["batch"], r.get("round")): r["decode_tok_s"] for r in rows if r["variant"] == "llama.cpp"}
    for r in rows:
        peer = peers.get((r["batch"], r.get("round")))
        r["x_llama_cpp"] = (round(r["decode_tok_s"] / peer, 3)
                            if peer and r["variant"] != "llama.cpp" and r.get("decode_tok_s") else None)
    return rows


def run_matrix(path, model, workloads: list[Workload], variants: list[str], rounds: int, common: dict,
               peer=None, arms: list[dict] | None = None) -> list[dict]:
    """Every variant at every workload, then (with `peer`, a LlamaBatchedBench) llama-batched-bench
    on the same file at the same batch sizes, in `rounds` rounds. A variant that fails keeps its
    error in its rows and the others go on. `arms` (option sets, as decode's `--ab`): each variant
    runs under each set in every round, one after another, the `options` column naming the set."""
    from harness.program.batch_forward import make_batch_forward

    arms = arms or [{}]
    rows = []
    for rnd in range(1, rounds + 1):
        for variant in variants:
            for arm in arms:
                for w in workloads:
                    base = dict(common, variant=variant, batch=w.batch, prompt=w.prompt, gen=w.gen, shared=w.shared,
                                mixed=int(w.mixed), round=rnd if rounds > 1 or peer else None,
                                options=options.describe_under(arm))
                    try:
                        with options.use(**arm):
                            pool = w.pool()
                            forward = make_batch_forward(model, variant, pool, w.prompt + w.gen)
                            # untimed first: the kernels this batch's shapes launch compile here, not in the timing
                            warm = Workload(w.batch, w.prompt, min(w.gen, 2), w.shared, w.mixed, w.seed + 1)
                            serve(forward, pool, warm.requests(model.config.vocab), w.batch)
                            served = serve(forward, pool, w.requests(model.config.vocab), w.batch)
                        rows.append(serve_row(base, served.summary()))
                    except Exception as exc:  # noqa: BLE001 - recorded in its row; the matrix goes on
                        rows.append(dict(serve_row(base, {}), error=f"{type(exc).__name__}: {exc}"))
        if peer is not None:
            same = [w for w in workloads if not w.shared and not w.mixed]
            for prompt, gen in dict.fromkeys((w.prompt, w.gen) for w in same):
                batches = [w.batch for w in same if (w.prompt, w.gen) == (prompt, gen)]
                base = dict(common, prompt=prompt, gen=gen, shared=0, mixed=0, round=rnd)
                try:
                    tests = peer.run(path, prompt, gen, batches)
                    rows += [peer_row(dict(base, batch=b), t, peer.build) for b, t in zip(batches, tests)]
                except Exception as exc:  # noqa: BLE001
                    rows += [dict(serve_row(dict(base, variant="llama.cpp", batch=b), {}),
                                  error=f"{type(exc).__name__}: {exc}") for b in batches]
    return pair_with_peer(rows)
