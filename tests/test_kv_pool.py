"""The paged cache's pool of blocks (harness.program.kv_pool) on the CPU: prefix sharing, forks and
copy on write, and 10,000 random arrivals, decode tokens, forks and finishes with the pool's
rows simulated, so that a block lost, leaked or written while shared shows as a wrong token."""

import numpy as np
import pytest

from harness.program.kv_pool import KVPool, PoolError


class Rows:
    """The device's cache as the pool's user writes it: block -> the token of each row."""

    def __init__(self, pool: KVPool):
        self.pool, self.rows = pool, np.full((pool.num_blocks, pool.block_size), -1)

    def write(self, seq, start: int, tokens, placement) -> None:
        for src, dst in placement.copies:  # the copies come first, as the kernels would run them
            self.rows[dst] = self.rows[src]
        bs = self.pool.block_size
        for i, tok in enumerate(tokens, start):
            blk = placement.table[i // bs]
            assert self.pool.refs[blk] == 1, f"row {i} of {seq!r} written into block {blk}, which is shared"
            self.rows[blk, i % bs] = tok

    def read(self, seq) -> list[int]:
        bs, n = self.pool.block_size, self.pool.length(seq)
        return [int(self.rows[blk, i % bs]) for i, blk in ((i, self.pool.table(seq)[i // bs]) for i in range(n))]


def test_prompts_share_whole_blocks_of_a_common_prefix():
    pool = KVPool(16, 4)
    system = [7, 7, 1, 2, 3, 4, 5, 6]  # two whole blocks
    a = pool.add("a", system + [10, 11])
    assert pool.add("early", system + [30]).prefilled == 0  # a's rows are not written yet
    pool.computed("a", 10)  # a step ran a's prompt
    b = pool.add("b", system + [20])
    assert b.table[:2] == a.table[:2] and b.prefilled == 8 and a.prefilled == 0
    assert pool.refs[a.table[0]] == 2 and b.table[2] != a.table[2]
    c = pool.add("c", [7, 7, 1, 2, 9, 9, 9, 9])  # the first block only; its last block stays its own
    assert c.table[0] == a.table[0] and c.table[1] not in a.table and c.prefilled == 4
    d = pool.add("d", system)  # a prompt that ends on a block edge: its last block is not shared
    assert d.table[0] == a.table[0] and d.table[1] != a.table[1] and d.prefilled == 4
    pool.check()
    for s in ("a", "b", "c", "d", "early"):
        pool.finish(s)
    pool.check()
    assert pool.free_blocks == 16


def test_a_fork_copies_the_shared_last_block_before_writing():
    pool = KVPool(8, 4)
    rows = Rows(pool)
    rows.write("p", 0, [1, 2, 3, 4, 5], pool.add("p", [1, 2, 3, 4, 5]))
    pool.computed("p", 5)
    pool.fork("p", "c")
    placed = pool.append("c", 6)
    assert placed.copies == [(pool.table("p")[1], placed.table[1])] and placed.table[0] == pool.table("p")[0]
    rows.write("c", 5, [6], placed)
    rows.write("p", 5, [9], pool.append("p", 9))  # the parent's block is its own again: no copy
    assert rows.read("p") == [1, 2, 3, 4, 5, 9] and rows.read("c") == [1, 2, 3, 4, 5, 6]
    pool.check()


def test_bad_requests_are_refused_and_change_nothing():
    pool = KVPool(4, 4)
    pool.add("a", list(range(9)))  # 3 blocks
    before = (list(pool.refs), pool.free_blocks)
    with pytest.raises(PoolError, match="empty prompt"):
        pool.add("e", [])
    with pytest.raises(PoolError, match="needs 5 blocks of 4; the pool has 4"):
        pool.add("long", list(range(17)))
    with pytest.raises(PoolError, match="2 free blocks needed, 1 free"):
        pool.add("b", list(range(100, 108)))
    with pytest.raises(PoolError, match="already in the pool"):
        pool.add("a", [1])
    with pytest.raises(PoolError, match="not in the pool"):
        pool.append("nobody", 1)
    assert (list(pool.refs), pool.free_blocks) == before
    pool.add("b", [5])  # the last block: the other sequence goes on
    for t in range(3):
        pool.append("a", t)  # fills a's third block
    with pytest.raises(PoolError, match="the pool is full"):
        pool.append("a", 99)
    pool.check()


def test_ten_thousand_random_arrivals_forks_tokens_and_finishes():
    rng = np.random.default_rng(2026)
    pool = KVPool(96, 4)
    rows = Rows(pool)
    want: dict[int, list[int]] = {}
    prefixes = [list(rng.integers(0, 50, n)) for n in (4, 8, 9, 12)]  # shared system prompts
    next_id, refused, shared_rows, copies = 0, 0, 0, 0
    for _ in range(10_000):
        op = rng.random()
        live = list(want)
        try:
            if op < 0.25 or not live:  # an arrival, often after a shared prefix
                prompt = (list(prefixes[rng.integers(len(prefixes))]) if rng.random() < 0.7 else []) + \
                    list(rng.integers(0, 50, rng.integers(1, 10)))
                placed = pool.add(next_id, prompt)
                rows.write(next_id, placed.prefilled, prompt[placed.prefilled:], placed)
                pool.computed(next_id, len(prompt))
                shared_rows += placed.prefilled
                want[next_id] = prompt
                next_id += 1
            elif op < 0.35:  # a fork
                parent = live[rng.integers(len(live))]
                pool.fork(parent, next_id)
                want[next_id] = list(want[parent])
                next_id += 1
            elif op < 0.80:  # a decode token
                s = live[rng.integers(len(live))]
                tok = int(rng.integers(0, 50))
                placed = pool.append(s, tok)
                copies += len(placed.copies)
                rows.write(s, len(want[s]), [tok], placed)
                pool.computed(s, len(want[s]) + 1)
                want[s].append(tok)
            else:  # a finish
                s = live[rng.integers(len(live))]
                pool.finish(s)
                del want[s]
        except PoolError:
            refused += 1
        pool.check()
        if rng.random() < 0.05:  # every sequence's rows, as its kernels would read them
            assert all(rows.read(s) == toks for s, toks in want.items())
    assert all(rows.read(s) == toks for s, toks in want.items())
    # the run exercised what it tests: sharing, copies on write, and a full pool's refusals
    assert shared_rows > 1000 and copies > 50 and refused > 10
    for s in list(want):
        pool.finish(s)
    pool.check()
    assert pool.free_blocks == pool.num_blocks and pool.occupancy() == 0.0
