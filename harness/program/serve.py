"""Continuous batching over the paged pool: which sequences run in each step of a batched decode.

Requests arrive at steps of their own, with prompts of their own lengths, and stop at their own
token counts. Each step the scheduler
- admits waiting requests in arrival order while the pool holds their prompts (kv_pool.KVPool:
  a shared prefix is not stored twice) and the batch has room;
- runs every admitted sequence one step: a new one its prompt's uncached tokens (prefill), the
  others their last token (decode);
- takes each sequence's next token from the step's results, appends it to the pool (a fresh
  block, or a copy of a shared one first), and ends the sequences that are done, whose blocks go
  back at once;
- where the pool has no block for a running sequence's next token, preempts the sequence admitted
  last: its blocks go back and it waits at the front of the queue with what it has generated, to
  be recomputed from its prompt and those tokens (vLLM's recompute preemption).

A bad request (an empty prompt, a prompt the whole pool cannot hold) is refused when it is
submitted, before any step, and the others go on. The model is a callable: the batched forward
of the decode loop on a GPU, or any function of a sequence's tokens in the tests.

A token the model gives may stand for one still on the device (batch_forward.DeviceToken): the
scheduler goes on without its value (a sequence ends by its count of tokens), passes it to the
next step as it is, and `settle` makes every finished request's tokens ints.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness.program.kv_pool import KVPool, PoolError


@dataclass(eq=False)  # a request is itself: `in` and `remove` compare identities, not fields
class Request:
    id: object
    prompt: list[int]
    max_new: int  # tokens to generate
    arrival: int = 0  # the step at which it may be admitted
    output: list[int] = field(default_factory=list)  # while running, the last may be on the device
    first_token_step: int | None = None  # the step that gave its first token
    finished_step: int | None = None
    preempted: int = 0  # times it gave its blocks back

    def token(self, i: int):
        """Token i of its prompt and then its output, without joining the two."""
        return self.prompt[i] if i < len(self.prompt) else self.output[i - len(self.prompt)]


@dataclass
class Work:
    """One sequence's part of a step: the tokens it runs (its uncached prompt, or its last token),
    from position `start`, with its block table and the copies to make before; `prefill` where
    they are the sequence's prompt (on admission, or again after a preemption)."""

    request: Request
    tokens: list[int]
    start: int
    table: list[int]
    copies: list[tuple[int, int]]
    prefill: bool = False


class Scheduler:
    def __init__(self, pool: KVPool, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.pool, self.max_batch = pool, max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.done: list[Request] = []
        self.step_count = 0
        self._copies: dict[object, list[tuple[int, int]]] = {}  # to make before a sequence's next write

    def submit(self, request: Request) -> None:
        """Queue a request; one that the pool could never hold is refused here, by name."""
        if not request.prompt:
            raise PoolError(f"request {request.id!r}: an empty prompt")
        if request.max_new < 1:
            raise PoolError(f"request {request.id!r}: max_new must be at least 1, got {request.max_new}")
        longest = len(request.prompt) + request.max_new
        if self.pool.blocks_for(longest) > self.pool.num_blocks:
            raise PoolError(f"request {request.id!r}: {longest} tokens need {self.pool.blocks_for(longest)} blocks; "
                            f"the pool has {self.pool.num_blocks}")
        self.waiting.append(request)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> list[Work]:
        work = []
        while self.waiting and len(self.running) < self.max_batch and self.waiting[0].arrival <= self.step_count:
            r = self.waiting[0]
            tokens = r.prompt + r.output  # a preempted request recomputes what it had
            # keep a block a running sequence free for its next token, so admitting does not
            # preempt at once
            if self.pool.blocks_for(len(tokens)) + len(self.running) > self.pool.free_blocks and self.running:
                break
            try:
                placed = self.pool.add(r.id, tokens)
            except PoolError:
                break  # it waits for blocks to come back
            self.waiting.popleft()
            self.running.append(r)
            work.append(Work(r, tokens[placed.prefilled:], placed.prefilled, placed.table, placed.copies, prefill=True))
        return work

    def _preempt(self) -> Request:
        r = self.running.pop()
        self.pool.finish(r.id)
        self._copies.pop(r.id, None)
        r.preempted += 1
        self.waiting.appendleft(r)
        return r

    def step(self, model: Callable[[list[Work]], dict]) -> list[Work]:
        """One batched step: `model(work)` gives each running sequence's next token {id: token}.
        Returns the step's work (empty where nothing could run)."""
        new = self._admit()
        admitted = {w.request.id for w in new}
        work = list(new)
        for r in self.running:
            if r.id not in admitted:  # its last token, whose row the pool gave it last step
                n = self.pool.length(r.id)
                work.append(Work(r, [r.token(n - 1)], n - 1, self.pool.table(r.id),
                                 self._copies.pop(r.id, [])))
        self.step_count += 1
        if not work:
            return []
        nxt = model(work)
        for w in work:  # the rows the step wrote: their whole blocks may be shared from now
            if w.request in self.running:
                self.pool.computed(w.request.id, w.start + len(w.tokens))
        for w in work:
            r = w.request
            if r not in self.running:  # preempted below, earlier in this loop: recomputed later
                continue
            r.output.append(nxt[r.id])  # as the model gave it: an int, or one still on the device
            if r.first_token_step is None:
                r.first_token_step = self.step_count
            if len(r.output) == r.max_new:
                self.running.remove(r)
                self.pool.finish(r.id)
                r.finished_step = self.step_count
                self.done.append(r)
                continue
            while True:  # a row for its token: preempt the last admitted until there is one
                try:
                    placed = self.pool.append(r.id, r.output[-1])
                    self._copies.setdefault(r.id, []).extend(placed.copies)
                    break
                except PoolError:
                    if self._preempt() is r:  # recomputed later from its prompt and its tokens
                        break
        return work

    def settle(self) -> None:
        """Every finished request's tokens as ints (reading those still on the device)."""
        for r in self.done:
            r.output = [int(t) for t in r.output]

    def run(self, model: Callable[[list[Work]], dict], max_steps: int = 1_000_000) -> list[Request]:
        """Steps until every request is done; the requests in the order they finished."""
        while not self.idle():
            if self.step_count >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            self.step(model)
        self.settle()
        return self.done
