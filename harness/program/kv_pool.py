"""The paged KV cache's bookkeeping for many sequences at once: one pool of blocks of
`block_size` token rows, each sequence a block table into it (the kernels' block_table rows).

- A sequence's prompt takes the blocks of any earlier sequence whose prompt began with the same
  whole blocks of tokens (a block's identity is its tokens and everything before them: a hash
  chain, as vLLM's prefix caching keys blocks), so a shared system prompt is stored once; only the
  rest is written, and `prefilled` says from which token. A block is findable once the caller
  says its rows are written (`computed`), not when they are reserved.
- `fork` gives a child every block of its parent (parallel sampling, a branch of a conversation).
- A block is written only while one table holds it: appending into a shared, partly filled block
  first copies it (copy on write), and the caller copies those rows on the device.
- A sequence that ends gives its blocks back; a block returns to the free list when no table
  holds it. Whole blocks stay findable by their tokens while a table holds them.

Nothing here touches the device: the decode loop turns the tables into int32 rows and runs the
copies the pool asks for. A request the pool cannot hold is refused before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class PoolError(ValueError):
    """A request the pool refuses (an empty prompt, more blocks than it has free, an unknown or
    repeated sequence): nothing was changed, and the other sequences go on."""


@dataclass
class Placement:
    """Where a sequence's tokens went: its block table, the tokens already in the pool from an
    earlier sequence's blocks (its prefill starts there), and the copies to make first (source
    block, destination block: whole blocks, rows 0..block_size-1)."""

    table: list[int]
    prefilled: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Seq:
    table: list[int]
    length: int  # tokens written
    chain: list[int]  # the hash of each whole block, in order (a block's tokens and all before them)
    tail: list[int]  # the tokens of the last block while it is not whole
    published: int = 0  # whole blocks findable by their tokens: those whose rows are written
    # whole blocks after `chain`'s, their hashes not yet taken: a decode step's tokens may still be
    # on the device (serve_pipelined), and a hash reads them; taken when the blocks are published
    unhashed: list[tuple] = field(default_factory=list)

    def hashes(self, upto: int) -> list[int]:
        """The chain's first `upto` hashes, taking those of unhashed blocks as needed."""
        while len(self.chain) < upto and self.unhashed:
            self.chain.append(hash((self.chain[-1] if self.chain else 0, self.unhashed.pop(0))))
        return self.chain


class KVPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of one row, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._by_hash: dict[int, int] = {}  # a whole block's chain hash -> the block holding it
        self._hash_of: dict[int, int] = {}  # and back
        self.seqs: dict[object, _Seq] = {}

    # ---- what the pool holds ------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def occupancy(self) -> float:
        """The share of the pool's blocks that some table holds."""
        return 1.0 - len(self._free) / self.num_blocks

    def table(self, seq) -> list[int]:
        return list(self._seq(seq).table)

    def length(self, seq) -> int:
        return self._seq(seq).length

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- requests -----------------------------------------------------------------------------------
    def add(self, seq, prompt: Sequence[int]) -> Placement:
        """A new sequence with its prompt's tokens: the whole blocks that an earlier prompt's
        blocks already hold (same tokens, same prefix) are shared; the rest get free blocks."""
        if seq in self.seqs:
            raise PoolError(f"sequence {seq!r} is already in the pool")
        if len(prompt) == 0:
            raise PoolError(f"sequence {seq!r}: an empty prompt (a sequence starts with at least one token)")
        need = self.blocks_for(len(prompt))
        if need > self.num_blocks:
            raise PoolError(f"sequence {seq!r}: a prompt of {len(prompt)} tokens needs {need} blocks of "
                            f"{self.block_size}; the pool has {self.num_blocks}")
        chain, shared, h = [], [], 0
        whole = len(prompt) // self.block_size
        # the block of the last token is never shared: its logits are computed here, and its
        # rows written, so a prefill always has at least that token to run
        sharable = (len(prompt) - 1) // self.block_size
        for b in range(whole):
            h = hash((h, tuple(prompt[b * self.block_size:(b + 1) * self.block_size])))
            chain.append(h)
            if len(shared) == b < sharable and h in self._by_hash:
                shared.append(self._by_hash[h])
        fresh = need - len(shared)
        if fresh > len(self._free):
            raise PoolError(f"sequence {seq!r}: {fresh} free blocks needed, {len(self._free)} free "
                            f"({self.num_blocks - len(self._free)} of {self.num_blocks} held)")
        table = list(shared)
        for blk in shared:
            self.refs[blk] += 1
        for _ in range(fresh):
            table.append(self._take())
        self.seqs[seq] = _Seq(table, len(prompt), chain, list(prompt[whole * self.block_size:]), len(shared))
        return Placement(list(table), prefilled=len(shared) * self.block_size)

    def append(self, seq, token: int) -> Placement:
        """One more token (a decode step): a fresh block where the last is full, a private copy
        where the last is shared and partly filled (copy on write). Refused, with nothing
        changed, where the pool has no block to give."""
        s = self._seq(seq)
        copies = []
        if s.length % self.block_size == 0:  # the last block is whole: a fresh one
            if not self._free:
                raise PoolError(f"sequence {seq!r}: no free block for token {s.length} (the pool is full)")
            s.table.append(self._take())
        elif self.refs[s.table[-1]] > 1:  # shared and partly filled: copied before it is written
            if not self._free:
                raise PoolError(f"sequence {seq!r}: no free block to copy its shared last block into")
            old, new = s.table[-1], self._take()
            self.refs[old] -= 1
            s.table[-1] = new
            copies.append((old, new))
        s.length += 1
        s.tail.append(token)
        if len(s.tail) == self.block_size:  # whole: findable once its rows are written (computed)
            s.unhashed.append(tuple(s.tail))
            s.tail = []
        return Placement(list(s.table), copies=copies)

    def computed(self, seq, rows: int) -> None:
        """The sequence's first `rows` rows are written (a step ran them): its whole blocks among
        them become findable by later prompts. A block is not shared before its rows exist: a
        prompt admitted beside the one that writes them would read rows not yet written."""
        s = self._seq(seq)
        whole = min(rows, s.length) // self.block_size
        chain = s.hashes(whole)
        for b in range(s.published, whole):
            self._publish(s.table[b], chain[b])
        s.published = max(s.published, whole)

    def fork(self, parent, child) -> Placement:
        """The child holds every block of the parent (none copied until one of them writes into a
        shared, partly filled block)."""
        p = self._seq(parent)
        if child in self.seqs:
            raise PoolError(f"sequence {child!r} is already in the pool")
        for blk in p.table:
            self.refs[blk] += 1
        self.seqs[child] = _Seq(list(p.table), p.length, list(p.chain), list(p.tail), p.published, list(p.unhashed))
        return Placement(list(p.table))

    def finish(self, seq) -> None:
        """The sequence ends: its blocks go back (to the free list when no other table holds them)."""
        s = self.seqs.pop(self._check_known(seq))
        for blk in s.table:
            self.refs[blk] -= 1
            if self.refs[blk] == 0:
                h = self._hash_of.pop(blk, None)
                if h is not None and self._by_hash.get(h) == blk:
                    del self._by_hash[h]
                self._free.append(blk)

    def check(self) -> None:
        """The pool's invariants (tests): each block's count is the number of tables holding it,
        a block is free exactly when none does, and every findable block is held with its hash."""
        held = [0] * self.num_blocks
        for s in self.seqs.values():
            for blk in s.table:
                held[blk] += 1
            assert len(s.table) == self.blocks_for(s.length), (len(s.table), s.length)
            assert len(s.chain) + len(s.unhashed) == s.length // self.block_size
            assert len(s.tail) == s.length % self.block_size
        assert held == self.refs, "a block's count is not the number of tables holding it"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if held[b] == 0}, "a free block is held, or one is lost"
        for h, blk in self._by_hash.items():
            assert self.refs[blk] > 0 and self._hash_of[blk] == h

    # ---- inner workings -----------------------------------------------------------------------------
    def _seq(self, seq) -> _Seq:
        return self.seqs[self._check_known(seq)]

    def _check_known(self, seq):
        if seq not in self.seqs:
            raise PoolError(f"sequence {seq!r} is not in the pool")
        return seq

    def _take(self) -> int:
        blk = self._free.pop()
        assert self.refs[blk] == 0, f"block {blk} on the free list is held"
        self.refs[blk] = 1
        return blk

    def _publish(self, blk: int, h: int) -> None:
        if h not in self._by_hash:
            self._by_hash[h] = blk
            self._hash_of[blk] = h
