"""A batch of sequences in one forward over the paged pool (harness.program.batch_forward), on the
CPU with MLX built-ins: each request's greedy tokens under continuous batching, with shared
prefixes and preemptions, are the tokens it decodes alone; a mixed step's logits (a new prompt, a
prompt after a shared prefix, decode tokens, one after a copy on write) are each sequence's alone."""

from __future__ import annotations

import numpy as np
import pytest

from harness.program.batch_forward import PagedBatchReference
from harness.program.decode import ReferenceDecoder, generate
from harness.program.kv_pool import KVPool
from harness.program.models import load_gguf, write_random_gguf
from harness.program.serve import Request, Scheduler, Work

PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-phi3")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    return {p: load_gguf(write_random_gguf(d / f"{p}.gguf", p, "q8_0", seed=7)) for p in PRESETS}


def alone(model, prompt: list[int], n: int) -> list[int]:
    return generate(ReferenceDecoder(model, 256), prompt, n).generated


@pytest.mark.parametrize("preset", PRESETS)
def test_a_batch_gives_each_request_its_tokens_alone(models, preset):
    """Twelve requests of 1-40 prompt tokens (half of them after a shared 24-token system
    prompt: whole blocks stored once), arriving over the first steps, 3-14 tokens each, at most
    5 at a time, in a pool small enough to preempt (gemma3: sliding windows of 8 tokens)."""
    model = models[preset]
    rng = np.random.default_rng(11)
    system = [int(t) for t in rng.integers(0, model.config.vocab, 24)]
    reqs = []
    for i in range(12):
        own = [int(t) for t in rng.integers(0, model.config.vocab, int(rng.integers(1, 17)))]
        reqs.append(Request(i, (system + own) if i % 2 else own, max_new=int(rng.integers(3, 15)),
                            arrival=int(rng.integers(0, 6))))
    pool = KVPool(num_blocks=11, block_size=8)
    sched = Scheduler(pool, max_batch=5)
    for r in reqs:
        sched.submit(r)
    forward = PagedBatchReference(ReferenceDecoder(model, 256), pool)
    done = sched.run(forward)
    assert len(done) == len(reqs) and pool.free_blocks == pool.num_blocks
    assert any(r.preempted for r in reqs), "the pool was meant to be small enough to preempt"
    for r in reqs:
        assert r.output == alone(model, r.prompt, r.max_new), f"request {r.id} ({len(r.prompt)} prompt tokens)"


def test_a_mixed_steps_logits_are_each_sequences_alone(models):
    """One step holding a new prompt; a prompt whose first two blocks another sequence wrote
    (shared, not recomputed); that sequence's decode token, after a fork made its partly filled
    last block shared (so its write copies the block first); and the fork's own decode token:
    each last token's logits as the same sequence gives them alone."""
    model = models["tiny-llama"]
    d = ReferenceDecoder(model, 256)
    pool = KVPool(num_blocks=16, block_size=4)
    forward = PagedBatchReference(d, pool)
    first = list(range(3, 14))  # 11 tokens: two whole blocks and three rows
    a = pool.add("a", first)
    forward.forward([Work(Request("a", first, 1), first, 0, a.table, a.copies)])
    pool.computed("a", len(first))
    pool.fork("a", "fork")
    grown = pool.append("a", 99)
    assert len(grown.copies) == 1 and grown.copies[0][0] == pool.table("fork")[2]
    assert pool.append("fork", 77).copies == []  # its block is no longer shared
    second = first[:8] + [40, 41, 42]
    b = pool.add("b", second)
    assert b.prefilled == 8 and b.table[:2] == pool.table("a")[:2]
    third = [7, 1, 5, 9, 2]
    c = pool.add("c", third)
    got = forward.forward([Work(Request("c", third, 1), third, 0, c.table, c.copies),
                           Work(Request("b", second, 1), second[8:], 8, b.table, b.copies),
                           Work(Request("a", first + [99], 1), [99], 11, grown.table, grown.copies),
                           Work(Request("fork", first + [77], 1), [77], 11, pool.table("fork"), [])])
    for row, tokens in zip(np.array(got), (third, second, first + [99], first + [77])):
        d.reset()
        want = np.array(d.forward(tokens)[-1])
        np.testing.assert_allclose(row, want, rtol=1e-4, atol=1e-4)


def test_a_step_past_its_table_is_refused(models):
    forward = PagedBatchReference(ReferenceDecoder(models["tiny-llama"], 64), KVPool(4, 4))
    with pytest.raises(ValueError, match="5 tokens at 0 with 1 blocks of 4"):
        forward.forward([Work(Request("x", [1] * 5, 1), [1] * 5, 0, [0], [])])
