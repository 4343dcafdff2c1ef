"""Continuous batching (harness.program.serve) on the CPU, with a stand-in model: each request's
tokens are what a batch of one would give, whatever it ran beside, however often it was
preempted; the cache rows each step reads (simulated through the block tables) are the
sequence's own; bad requests are refused at submission and the others go on."""

import numpy as np
import pytest

from harness.program.kv_pool import KVPool, PoolError
from harness.program.serve import Request, Scheduler

VOCAB = 50


def next_token(tokens) -> int:
    """The stand-in model's greedy choice: a function of the whole sequence, as a decoder's is."""
    return hash(tuple(tokens)) % VOCAB


def alone(prompt: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


class Model:
    """Runs a step's work over simulated cache rows: the copies first, then each sequence reads
    its rows before `start` through its table (they must hold its own tokens), writes its tokens'
    rows (never into a block another table holds) and gives its next token."""

    def __init__(self, pool: KVPool):
        self.pool, self.rows, self.steps, self.batch = pool, np.full((pool.num_blocks, pool.block_size), -1), 0, []

    def __call__(self, work):
        self.steps += 1
        self.batch.append(len(work))
        bs = self.pool.block_size
        for w in work:
            for src, dst in w.copies:
                self.rows[dst] = self.rows[src]
        out = {}
        for w in work:
            seq = w.request.prompt + w.request.output
            assert w.start + len(w.tokens) == len(seq) and seq[w.start:] == w.tokens
            cached = [int(self.rows[w.table[i // bs], i % bs]) for i in range(w.start)]
            assert cached == seq[:w.start], f"request {w.request.id}: its cache rows are not its tokens"
            for i, tok in enumerate(w.tokens, w.start):
                blk = w.table[i // bs]
                assert self.pool.refs[blk] == 1, f"request {w.request.id} writes block {blk}, which is shared"
                self.rows[blk, i % bs] = tok
            out[w.request.id] = next_token(seq)
        return out


def test_a_batch_gives_each_request_its_batch_of_one_tokens():
    pool = KVPool(64, 4)
    sched = Scheduler(pool, max_batch=4)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    reqs = [Request(i, system + [10 + i] * (i + 1), max_new=3 + 2 * i, arrival=i) for i in range(6)]
    for r in reqs:
        sched.submit(r)
    model = Model(pool)
    done = sched.run(model)
    assert sorted(r.id for r in done) == list(range(6))
    for r in reqs:
        assert r.output == alone(r.prompt, r.max_new)
    assert max(model.batch) == 4 and pool.free_blocks == pool.num_blocks
    pool.check()


def test_bad_requests_are_refused_at_submission_and_the_others_go_on():
    pool = KVPool(8, 4)
    sched = Scheduler(pool, max_batch=2)
    with pytest.raises(PoolError, match="empty prompt"):
        sched.submit(Request("e", [], 3))
    with pytest.raises(PoolError, match="40 tokens need 10 blocks; the pool has 8"):
        sched.submit(Request("long", list(range(30)), 10))
    with pytest.raises(PoolError, match="max_new"):
        sched.submit(Request("none", [1], 0))
    sched.submit(Request("ok", [1, 2, 3], 5))
    (r,) = sched.run(Model(pool))
    assert r.output == alone([1, 2, 3], 5)


def test_a_full_pool_preempts_the_last_admitted_and_recomputes_it():
    pool = KVPool(6, 2)  # 12 rows for three sequences that want 8 each
    sched = Scheduler(pool, max_batch=3)
    reqs = [Request(i, [i + 1, i + 2], max_new=6) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    model = Model(pool)
    sched.run(model)
    assert all(r.output == alone(r.prompt, 6) for r in reqs)
    assert sum(r.preempted for r in reqs) > 0 and reqs[0].preempted == 0  # the first admitted keeps going
    pool.check()
    assert pool.free_blocks == 6


def test_random_arrivals_lengths_and_stops():
    rng = np.random.default_rng(60)
    pool = KVPool(24, 4)  # eight sequences of up to 43 tokens want more: some are preempted
    sched = Scheduler(pool, max_batch=8)
    prefixes = [list(rng.integers(0, VOCAB, n)) for n in (4, 8, 13)]
    reqs = []
    for i in range(200):
        prompt = (list(prefixes[rng.integers(3)]) if rng.random() < 0.6 else []) + list(
            rng.integers(0, VOCAB, rng.integers(1, 12)))
        reqs.append(Request(i, prompt, max_new=int(rng.integers(1, 20)), arrival=int(rng.integers(0, 300))))
    for r in reqs:
        sched.submit(r)
    model = Model(pool)
    checked = 0
    while not sched.idle():
        sched.step(model)
        pool.check()
        checked += 1
    assert all(r.output == alone(r.prompt, r.max_new) for r in reqs)
    assert all(r.first_token_step is not None and r.finished_step >= r.first_token_step >= r.arrival for r in reqs)
    assert pool.free_blocks == pool.num_blocks
    # the run exercised what it tests: batches of several, shared prefixes, and preemptions
    assert max(model.batch) >= 6 and sum(r.preempted for r in reqs) > 0 and checked > 300
