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


@pytest.mark.parametrize("pipelined", [False, True])
def test_pipelined_tokens_stay_on_the_device_until_asked(models, pipelined):
    """serve_pipelined: the forward gives DeviceTokens, reads each step when the next is queued
    (one step in flight), and the scheduler's run (preemptions, shared prefixes, the pool's block
    hashes over such tokens) ends with the tokens the unpipelined forward gives."""
    from harness.program.batch_forward import DeviceToken
    from kernels import options

    model = models["tiny-qwen3"]
    rng = np.random.default_rng(5)
    system = [int(t) for t in rng.integers(0, model.config.vocab, 16)]

    def run():
        reqs = [Request(i, system + [int(t) for t in rng_i.integers(0, model.config.vocab, 1 + i)],
                        max_new=9 + i, arrival=i // 2) for i, rng_i in enumerate(np.random.default_rng(9).spawn(6))]
        pool = KVPool(num_blocks=7, block_size=8)
        sched = Scheduler(pool, max_batch=4)
        for r in reqs:
            sched.submit(r)
        forward = PagedBatchReference(ReferenceDecoder(model, 256), pool)
        given, decode_only = [], []

        def step(work):
            if forward.lag and all(len(w.tokens) == 1 and isinstance(w.tokens[0], DeviceToken) for w in work):
                # a decode-only step is built without reading the last step's tokens (the pool
                # hashes a filled block's tokens later, when it publishes the block)
                assert all(w.tokens[0].step._values is None for w in work)
                decode_only.append(len(work))
            out = forward(work)
            given.append(list(out.values()))
            if forward.lag:  # the step before this one is read, this one is not yet
                assert all(t.step._values is None for t in given[-1])
                assert len(given) < 2 or all(t.step._values is not None for t in given[-2])
            return out

        sched.run(step)
        assert pool.free_blocks == pool.num_blocks and (len(decode_only) > 10 or not forward.lag)
        return reqs, given

    with options.use(serve_pipelined=pipelined):
        reqs, given = run()
    assert all(isinstance(t, DeviceToken) == pipelined for step in given for t in step)
    assert any(r.preempted for r in reqs), "the pool was meant to be small enough to preempt"
    with options.use(serve_pipelined=False):
        plain, _ = run()
    assert [r.output for r in reqs] == [r.output for r in plain]
    for r in reqs:
        assert r.output == alone(model, r.prompt, r.max_new)


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


def test_decode_slots_are_each_sequences_slots_of():
    """decode_slots (a decode-only step's slots from its table array) against slots_of a sequence
    at a time, over tables of different lengths padded to one width, positions on block edges;
    a table too short for its token refused, by request."""
    from harness.program.batch_forward import PagedBatchKernels, decode_slots, slots_of

    rng, bs = np.random.default_rng(3), 16
    work = []
    for i, start in enumerate([0, 15, 16, 17, 255, 40, 31, 32]):
        blocks = [int(b) for b in rng.permutation(200)[: start // bs + 1 + int(rng.integers(0, 3))]]
        work.append(Work(Request(i, [1], 1), [1], start, blocks, []))
    table = PagedBatchKernels._table(work, 32)
    starts = np.array([w.start for w in work], np.int32)
    want = np.concatenate([slots_of(w, bs, w.start) for w in work])
    got = decode_slots(work, table, starts, bs)
    assert got.dtype == np.int32 and (got == want).all()
    work[5] = Work(Request("short", [1], 1), [1], 48, work[5].table[:3], [])
    with pytest.raises(ValueError, match="request 'short': 1 token at 48 with 3 blocks of 16"):
        decode_slots(work, PagedBatchKernels._table(work, 32), np.array([w.start for w in work], np.int32), bs)


def test_a_requests_token_reads_its_prompt_then_its_output():
    r = Request("r", [5, 6, 7], 4, output=[8, 9])
    assert [r.token(i) for i in range(5)] == r.prompt + r.output


def _mixed_step(pool, vocab):
    """Two decode tokens (one after a long prompt) and two prompts, one after a shared prefix."""
    rng = np.random.default_rng(5)
    seqs = {n: [int(t) for t in rng.integers(0, vocab, length)] for n, length in
            (("a", 40), ("b", 7), ("c", 21))}
    work = []
    for name in ("a", "b"):
        placed = pool.add(name, seqs[name])
        pool.computed(name, len(seqs[name]))
        grown = pool.append(name, 1)
        work.append(Work(Request(name, seqs[name], 1), [1], len(seqs[name]), grown.table, grown.copies))
    d_prompt = seqs["a"][:32] + [3, 4, 5]
    d = pool.add("d", d_prompt)
    c = pool.add("c", seqs["c"])
    work.insert(1, Work(Request("d", d_prompt, 1), d_prompt[d.prefilled:], d.prefilled, d.table, d.copies, True))
    work.append(Work(Request("c", seqs["c"], 1), seqs["c"], 0, c.table, c.copies, True))
    return work


@pytest.mark.parametrize("variant", ["unfused", "fused"])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma3"])
def test_the_kernel_batch_launches_one_attention_for_the_decode_tokens(models, preset, variant):
    """lathe's kernels over a mixed step (launches recorded, CPU): RoPE of every token at its own
    position with its K/V written at its slot (one launch), one paged_attention for the decode
    tokens and a prefill_attention a prompt, each layer; the logits a row a sequence."""
    from harness.program.batch_forward import PagedBatchKernels
    from kernels.runtime import recording

    model = models[preset]
    pool = KVPool(num_blocks=24, block_size=16)
    with recording():
        forward = PagedBatchKernels(model, variant, pool, 128)
    work = _mixed_step(pool, model.config.vocab)
    assert work[1].start == 32  # the shared prefix's two blocks are not recomputed
    with recording() as rec:
        logits = forward.forward(work)
    assert logits.shape == (4, model.config.vocab)
    names = [j.spec.name for j in rec.jobs]
    layers = model.config.n_layers
    # RoPE of q and k, K/V at their slots; fused, Qwen3's head norms in the same launch
    fold = model.config.head_norm and variant == "fused"
    write = "lathe_head_norm_rope_kv_write_paged" if fold else "lathe_rope_kv_write_paged"
    assert sum(n == write for n in names) == layers
    assert {n for n in names if n.startswith(("lathe_rope", "lathe_head_norm", "lathe_reshape_and_cache"))} == {write}
    assert sum(n == "lathe_head_rmsnorm" for n in names) == (2 * layers if model.config.head_norm and not fold else 0)
    assert sum(n.startswith("lathe_paged_attention") for n in names) == layers  # the two decode tokens, one launch
    assert sum(n.startswith("lathe_paged_prefill") for n in names) == 2 * layers
    writes = [j for j in rec.jobs if j.spec.name == write]
    # fused: Q, K and V read from the QKV projection's rows (paged_qkv_rows), not slices MLX would copy
    q, k, v = (writes[0].inputs[writes[0].spec.inputs.index(n)] for n in "qkv")
    assert (q is k is v) == (variant == "fused")
    slots = np.array(writes[0].inputs[writes[0].spec.inputs.index("slots")])
    t = sum(len(w.tokens) for w in work)
    want = np.concatenate([np.asarray(w.table)[np.arange(w.start, w.start + len(w.tokens)) // 16] * 16
                           + np.arange(w.start, w.start + len(w.tokens)) % 16 for w in work])
    assert slots.shape == (t,) and (slots == want).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unfused", "fused", "fused/paged_qkv_rows=off", "fused/serve_rope_attention=off",
                                     "fused/qmm_prologue=off", "fused/qmm_mma=on", "fused/qmm_prologue=off,qmm_mma=on",
                                     "fused/serve_cache_outputs=on", "megafused", "megafused/serve_mega_rows=4",
                                     "megafused/serve_mega_extra=0", "megafused/serve_cache_outputs=on",
                                     "fused/serve_device_inputs=off", "megafused/serve_device_inputs=off"])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_kernel_batch_decodes_each_sequence_as_the_model_and_as_alone(models, preset, variant, request):
    """lathe's kernels under continuous batching (shared prefixes, preemptions, batches of 1-5
    and prompts of 1-48 tokens): each step's logits of each sequence within 1e-2 of the float64
    model's on that sequence's own tokens, its greedy token the model's where the top-2 margin is
    clear, and its tokens the same variant's decoding it alone up to the first unclear margin
    (megafused: fused's alone, the paged decoder's). megafused's decode steps of 5 sequences are
    one token_block launch (serve_mega_rows 8), or two (4 and 1) with serve_mega_rows=4, or fused's
    plan with serve_mega_extra=0 (every step past one sequence). paged_qkv_rows=off: the RoPE + K/V
    write from MLX slices of the fused QKV, not its rows; serve_rope_attention=off: fused's decode-only
    steps with the paged write apart from paged_attention; qmm_prologue=off: the steps of 5 rows with
    lathe's rmsnorm before qmm, the norms after O and down in qmm's adding launch (qmm_norm_after);
    qmm_mma=on: qmm's plain launches on qmm_mma, whose auto leaves these small matrices to qmm;
    serve_cache_outputs=on: the compiled decode steps return the pools besides the logits."""
    from harness.program.batch_forward import PagedBatchKernels
    from harness.program.kernel_decode import KernelDecoder
    from kernels import options
    import mlx.core as mx

    from reference import rel_err
    from reference.model import forward as float64

    variant, _, setting = variant.partition("/")
    if setting:  # for the whole test, the forward made below included
        held = options.use(**options.parse(setting))
        held.__enter__()
        request.addfinalizer(lambda: held.__exit__(None, None, None))
    if variant == "megafused" and preset in MEGA_REFUSED:
        pytest.skip("the megafused batch variant refuses this layer (test_megafused_batch_refuses_...)")
    model = models[preset]
    rng = np.random.default_rng(13)
    system = [int(t) for t in rng.integers(0, model.config.vocab, 40)]
    reqs = [Request(i, (system + [int(t) for t in rng.integers(0, model.config.vocab, int(rng.integers(1, 9)))])
                    if i % 2 else [int(t) for t in rng.integers(0, model.config.vocab, int(rng.integers(1, 30)))],
                    max_new=int(rng.integers(4, 24)), arrival=int(rng.integers(0, 6))) for i in range(10)]
    pool = KVPool(num_blocks=6, block_size=16)  # small enough to preempt twice
    sched = Scheduler(pool, max_batch=5)
    for r in reqs:
        sched.submit(r)
    batch = PagedBatchKernels(model, variant, pool, 128)
    seen: dict = {}  # request -> {tokens before it: the logits} (a step undone by a preemption is redone)

    def step(work):
        logits = np.array(batch.forward(work).astype(mx.float32))
        for w, row in zip(work, logits):
            seen.setdefault(w.request.id, {})[len(w.request.prompt) + len(w.request.output)] = row
        return {w.request.id: int(np.argmax(row)) for w, row in zip(work, logits)}

    sched.run(step)
    assert any(r.preempted for r in reqs) and pool.free_blocks == pool.num_blocks
    clear_steps = 0
    for r in reqs:
        want, _ = float64(model, r.prompt + r.output[:-1])
        alone = generate(KernelDecoder(model, 128, "fused" if variant == "megafused" else variant, "paged"),
                         r.prompt, r.max_new).generated
        agree = True
        assert sorted(seen[r.id]) == list(range(len(r.prompt), len(r.prompt) + r.max_new))
        for n, row in sorted(seen[r.id].items()):
            target = want[n - 1]
            assert rel_err(row, target) <= 1e-2, (r.id, n)
            top2 = np.sort(target)[-2:]
            clear = (top2[1] - top2[0]) > 1e-2 * abs(top2[1])
            if clear:
                assert int(np.argmax(row)) == int(np.argmax(target)), (r.id, n)
                clear_steps += 1
            agree = agree and clear
            if agree:
                assert r.output[n - len(r.prompt)] == alone[n - len(r.prompt)], (r.id, n)
    assert clear_steps > sum(r.max_new for r in reqs) // 2


@pytest.mark.gpu
@pytest.mark.parametrize("cache_outputs", [True, False])
@pytest.mark.parametrize("variant", ["fused", "megafused"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_the_pipelined_kernel_batch_gives_the_tokens_of_the_unpipelined(models, preset, variant, cache_outputs,
                                                                          monkeypatch):
    """serve_pipelined on lathe's fused kernels: decode-only steps take their ids from the last
    step's argmax on the device, and every request ends with the tokens of the run that reads each
    step's tokens before building the next (the same launches on the same inputs). Also with the
    compiled steps' pools not among their outputs (serve_cache_outputs=off): their in-place writes
    are then ordered only by the stream and the tokens."""
    from harness.program.batch_forward import PagedBatchKernels
    from kernels import options

    model = models[preset]
    on_device = []
    pick = PagedBatchKernels._ids_on_device
    monkeypatch.setattr(PagedBatchKernels, "_ids_on_device",
                        staticmethod(lambda work: on_device.append(pick(work) is not None) or pick(work)))

    def run(pipelined: bool):
        rng = np.random.default_rng(17)
        system = [int(t) for t in rng.integers(0, model.config.vocab, 20)]
        reqs = [Request(i, system + [int(t) for t in rng.integers(0, model.config.vocab, int(rng.integers(1, 12)))],
                        max_new=int(rng.integers(6, 30)), arrival=int(rng.integers(0, 4))) for i in range(7)]
        pool = KVPool(num_blocks=12, block_size=16)
        sched = Scheduler(pool, max_batch=5)
        for r in reqs:
            sched.submit(r)
        with options.use(serve_pipelined=pipelined, serve_cache_outputs=cache_outputs):
            sched.run(PagedBatchKernels(model, variant, pool, 128))
        assert pool.free_blocks == pool.num_blocks
        return [r.output for r in reqs]

    plain = run(False)
    assert not any(on_device)
    pipelined = run(True)
    assert any(on_device), "no decode step took its ids from the device"
    assert pipelined == plain


@pytest.mark.parametrize("variant", ["unfused", "fused", "megafused"])
def test_the_kernel_batch_runs_every_phase_under_the_scheduler(models, variant):
    """A whole continuous-batching run on lathe's kernels, launches recorded (CPU): steps of 1, 2-4,
    5-64 and more than 64 tokens (each phase's plan), decode tokens beside prompts, a prompt after a
    shared prefix; every step's tables, lengths and slots pass the kernels' host checks, and each
    step gives a token a sequence."""
    from harness.program.batch_forward import PagedBatchKernels
    from kernels.runtime import recording

    model = models["tiny-qwen3"]
    rng = np.random.default_rng(21)
    system = [int(t) for t in rng.integers(0, model.config.vocab, 40)]
    lengths = [70, 3, 12, 1, 30, 5]
    reqs = [Request(i, (system if i % 3 == 1 else []) + [int(t) for t in rng.integers(0, model.config.vocab, n)],
                    max_new=int(rng.integers(3, 12)), arrival=i) for i, n in enumerate(lengths)]
    pool = KVPool(num_blocks=9, block_size=16)
    sched = Scheduler(pool, max_batch=4)
    for r in reqs:
        sched.submit(r)
    with recording():
        forward = PagedBatchKernels(model, variant, pool, 128)
    sizes = []

    def step(work):
        sizes.append(sum(len(w.tokens) for w in work))
        with recording():
            out = forward(work)
        assert sorted(out) == sorted(w.request.id for w in work)
        return out

    sched.run(step)
    assert all(len(r.output) == r.max_new for r in reqs) and pool.free_blocks == pool.num_blocks
    # steps of decode tokens only went through compiled forwards, one per batch and table width
    # (a power of two blocks)
    assert forward._compiled and all(width & (width - 1) == 0 for _, width, _ in forward._compiled)
    phases = {"decode" if t == 1 else "short" if t <= 4 else "gemm" if t <= 64 else "prompt" for t in sizes}
    assert phases == {"decode", "short", "gemm", "prompt"}, sorted(set(sizes))


MEGA_REFUSED = {"tiny-gemma3": "post-block norms", "tiny-phi3": "fused attn_qkv"}


@pytest.mark.parametrize("preset", sorted(MEGA_REFUSED))
def test_megafused_batch_refuses_the_layers_its_batch_form_does_not_take(models, preset):
    """Gemma's layer (post-block norms, a float32 stream) and Phi-3's fused tensors: refused by
    name when the forward is made, pointing to fused."""
    from harness.program.batch_forward import make_batch_forward

    with pytest.raises(ValueError, match=f"megafused batch variant does not run .*{MEGA_REFUSED[preset]}.*--variant fused"):
        make_batch_forward(models[preset], "megafused", KVPool(num_blocks=8, block_size=16), 64)


SIX = [3, 17, 40, 1, 16, 9]  # the cached tokens of six sequences a megafused decode step takes


def _six_decoding(model, seed: int, variant: str = "megafused"):
    """A batch forward of `variant` (made with its launches recorded) over a pool holding six
    sequences of SIX tokens and each one's next token: (forward, pool, the step's work, the rng)."""
    from harness.program.batch_forward import PagedBatchKernels
    from kernels.runtime import recording

    pool = KVPool(num_blocks=24, block_size=16)
    with recording():
        forward = PagedBatchKernels(model, variant, pool, 128)
    rng = np.random.default_rng(seed)
    work = []
    for i, n in enumerate(SIX):
        pool.add(i, [int(t) for t in rng.integers(0, model.config.vocab, n)])
        token = int(rng.integers(model.config.vocab))
        pool.append(i, token)  # the token's row in the pool
        work.append(Work(Request(i, [], 1), [token], n, pool.table(i), []))
    return forward, pool, work, rng


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_fused_decode_step_ropes_in_its_attention_launch(models, preset, on):
    """serve_rope_attention (CPU, launches recorded): fused's decode-only step of 6 sequences runs
    each layer's RoPE, K/V write and attention as one paged_rope_attention launch over the step's
    QKV rows, positions and block tables; off, the paged write, then paged_attention. (A step with
    a prompt keeps them apart: test_the_kernel_batch_launches_one_attention_for_the_decode_tokens.)"""
    from kernels import options
    from kernels.runtime import recording

    model = models[preset]
    c = model.config
    forward, _, work, _ = _six_decoding(model, 5, "fused")
    with recording() as rec, options.use(serve_compiled=False, serve_rope_attention=on):
        assert forward.forward(work).shape == (len(work), c.vocab)
    names = [j.spec.name for j in rec.jobs]
    together = [j for j in rec.jobs if "rope_attention" in j.spec.name]
    assert len(together) == (c.n_layers if on else 0)
    assert sum(n.endswith("kv_write_paged") for n in names) == (0 if on else c.n_layers)
    assert sum(n.startswith("lathe_paged_attention") for n in names) == (0 if on else c.n_layers)
    if on:
        given = dict(zip(together[0].spec.inputs, together[0].inputs))
        assert given["qkv"].shape == (len(work), (c.n_heads + 2 * c.n_kv_heads) * c.head_dim)
        assert np.array(given["pos"]).tolist() == [w.start for w in work]
        table = np.array(given["table"])
        for row, w in zip(table, work):
            assert row[:len(w.table)].tolist() == list(w.table)
        assert ("q_norm" in given) == bool(c.head_norm)


@pytest.mark.parametrize("combine", ["launch", "last_group"])
@pytest.mark.parametrize("rope_attention", [True, False])
def test_serve_split_from_splits_a_decode_steps_short_contexts(models, rope_attention, combine):
    """serve_split_from 0 (CPU, launches recorded): fused's decode-only step of six sequences of
    at most 41 tokens splits each layer's attention into partitions (of 16 tokens here: the auto
    partition is whole chunks of 128, past these tables), merged by a launch of its own or by the
    last threadgroup of each head group (attn_combine); the default (2048) keeps one threadgroup
    a kv head's whole context, as before."""
    from kernels import options
    from kernels.runtime import recording

    model = models["tiny-qwen3"]
    n_layers = model.config.n_layers
    forward, _, work, _ = _six_decoding(model, 5, "fused")
    for split_from, split in ((2048, False), (0, True)):
        with recording() as rec, options.use(serve_compiled=False, serve_rope_attention=rope_attention,
                                             serve_split_from=split_from, attn_combine=combine,
                                             attn_partition=16):
            forward.forward(work)
        combines = [j for j in rec.jobs if "combine" in j.spec.name]
        attn = [j for j in rec.jobs if "attention" in j.spec.name and "combine" not in j.spec.name]
        assert len(attn) == n_layers and all(("rope" in j.spec.name) == rope_attention for j in attn)
        assert all(("part_out" in j.spec.outputs) == split for j in attn)
        assert len(combines) == (n_layers if split and combine == "launch" else 0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_a_megafused_decode_step_is_token_block_launches_of_four(models, preset):
    """megafused's decode-only step of 6 sequences (launches recorded, CPU): the embedding, two
    token_block launches over the paged pool (sequences 0-3, then 4-5: each its rows of x, of the
    positions and of the table) and the head; no layer's own launches. A step with a prompt runs
    fused's plan (no token_block)."""
    from kernels import options
    from kernels.runtime import recording

    model = models[preset]
    with options.use(serve_mega_rows=4):
        forward, pool, work, rng = _six_decoding(model, 5)
    lengths = SIX
    with recording() as rec, options.use(serve_compiled=False):  # (a compiled step's inputs are its tracers)
        logits = forward.forward(work)
    assert logits.shape == (6, model.config.vocab)
    names = [j.spec.name for j in rec.jobs]
    blocks = [j for j in rec.jobs if j.spec.name.startswith("lathe_token_block")]
    assert len(blocks) == 2 and all("_paged" in j.spec.name for j in blocks)
    assert len(names) <= 6, names  # embed, 2 token_block, the head's norm and GEMM (6 rows: qmm)
    assert not any(n.startswith(("lathe_paged_attention", "lathe_rope", "lathe_head_norm")) for n in names)
    queues = [id(dict(zip(j.spec.inputs, j.inputs))["queue"]) for j in blocks]
    assert queues[0] != queues[1]  # a step's launches share no queue (nothing orders them)
    for j, rows in zip(blocks, (range(0, 4), range(4, 6))):
        got = dict(zip(j.spec.inputs, j.inputs))
        assert np.array(got["pos"]).tolist() == [lengths[r] for r in rows]
        table = np.array(got["table"])
        assert table.shape[0] == len(rows)
        for row, r in enumerate(rows):
            assert table[row, :len(pool.table(r))].tolist() == pool.table(r)
        assert got["x_in"].shape == (len(rows), model.config.d_model)
    prompt = [Work(Request(9, [], 1), [int(t) for t in rng.integers(0, model.config.vocab, 5)], 0, [], [])]
    pool.add(9, prompt[0].tokens)
    prompt = [Work(prompt[0].request, prompt[0].tokens, 0, pool.table(9), [])]
    with recording() as rec:
        forward.forward(prompt + work[:2])
    assert not any(j.spec.name.startswith("lathe_token_block") for j in rec.jobs)


@pytest.mark.parametrize("rows, launches", [(8, [range(0, 6)]), (2, [range(0, 2), range(2, 4), range(4, 6)])])
def test_serve_mega_rows_sets_the_sequences_a_token_block_launch_takes(models, rows, launches):
    """serve_mega_rows (CPU, launches recorded): the step of six sequences as launches of that many
    (8: one launch over all six, the batch form's most; 2: three), each its own rows and queue;
    past kernels.blocks.BATCH_ROWS the forward is refused when it is made."""
    from harness.program.batch_forward import PagedBatchKernels
    from kernels import options
    from kernels.runtime import recording

    model = models["tiny-qwen3"]
    with options.use(serve_mega_rows=rows):
        forward, _, work, _ = _six_decoding(model, 7)
    with recording() as rec, options.use(serve_compiled=False):
        assert forward.forward(work).shape == (6, model.config.vocab)
    jobs = [j for j in rec.jobs if j.spec.name.startswith("lathe_token_block")]
    assert [np.array(dict(zip(j.spec.inputs, j.inputs))["pos"]).tolist() for j in jobs] == \
        [[SIX[r] for r in want] for want in launches]
    assert len({id(dict(zip(j.spec.inputs, j.inputs))["queue"]) for j in jobs}) == len(launches)
    with options.use(serve_mega_rows=9), pytest.raises(ValueError, match=r"serve_mega_rows must be 1\.\.8"):
        PagedBatchKernels(model, "megafused", KVPool(num_blocks=8, block_size=16), 64)


@pytest.mark.parametrize("extra, token_blocks", [(None, [1, 1]), (0, [1, 0])])
def test_serve_mega_extra_sends_a_step_past_it_to_fuseds_plan(models, extra, token_blocks):
    """serve_mega_extra (CPU, launches recorded): a step of 1 sequence always runs token_block's
    batch form (it adds no products); a step of 6 adds 5 x the layers' weights, within the
    default (8000 million) for a tiny model and past 0, which runs fused's plan (no token_block)."""
    from kernels import options
    from kernels.runtime import recording

    model = models["tiny-qwen3"]
    forward, _, work, _ = _six_decoding(model, 3)
    c = model.config
    per_layer = ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim * c.d_model + c.d_model * c.n_heads * c.head_dim
                 + 3 * c.ff * c.d_model)
    assert forward.d.stacks.values == c.n_layers * per_layer
    got = []
    for step in (work[:1], work):
        with recording() as rec, options.use(serve_compiled=False, **({} if extra is None else {"serve_mega_extra": extra})):
            assert forward.forward(step).shape == (len(step), c.vocab)
        got.append(sum(j.spec.name.startswith("lathe_token_block") for j in rec.jobs))
    assert got == token_blocks


@pytest.mark.parametrize("together", [False, True])
def test_a_megafused_steps_launches_together_take_the_pool_as_found_and_split_the_gpu(models, monkeypatch, together):
    """serve_mega_together (CPU, launches recorded): a step of 6 sequences' two token_block
    launches both read the pool the step found, each sized to half the threadgroups the GPU holds
    (a resident fit of 8 stood in for the device's: gate|up's claimed tickets at most 4); off, the
    second reads the first's pool and both take the whole fit."""
    from kernels import blocks, options
    from kernels.runtime import recording

    with options.use(serve_mega_rows=4):
        forward, _, work, _ = _six_decoding(models["tiny-llama"], 6)
    monkeypatch.setattr(blocks, "resident_groups", lambda job: 8)
    found = forward.d.k[0]
    with recording() as rec, options.use(serve_compiled=False, serve_mega_together=together):
        forward.forward(work)
    jobs = [j for j in rec.jobs if j.spec.name.startswith("lathe_token_block")]
    assert len(jobs) == 2
    pools = [dict(zip(j.spec.inputs, j.inputs))["k_cache_0"] for j in jobs]
    groups = [int(np.array(dict(zip(j.spec.inputs, j.inputs))["up_dims"])[2]) for j in jobs]
    assert pools[0] is found
    if together:
        assert pools[1] is found and max(groups) <= 4
        assert forward.d.k[0] is not found  # the step's pool comes after both launches' writes
    else:
        assert pools[1] is not found and min(groups) > 4


@pytest.mark.parametrize("on", [True, False])
def test_a_kernel_step_reads_its_tokens_from_argmax_host_words(models, monkeypatch, on):
    """serve_token_words (CPU, launches recorded): a decode-only step of six sequences ends in one
    argmax launch that also writes the tokens as three 8-byte host words, which the host reads;
    its compiled forward takes the step's host-made arrays (positions, slots, table, lengths) as
    views of one array; off, the int32 tokens are read and the arrays are made one by one."""
    from harness.program import batch_forward
    from kernels import options
    from kernels.runtime import recording

    made = []
    real = batch_forward.views
    monkeypatch.setattr(batch_forward, "views", lambda flat, shapes: made.append(shapes) or real(flat, shapes))
    forward, _, work, _ = _six_decoding(models["tiny-qwen3"], 5, "fused")
    with recording() as rec, options.use(serve_token_words=on, serve_pipelined=False):
        tokens = forward(work)
    assert rec.jobs[-1].spec.name == ("lathe_argmax_host3" if on else "lathe_argmax")
    assert sorted(tokens) == [w.request.id for w in work] and all(isinstance(t, int) for t in tokens.values())
    if on:
        (shapes,) = made
        width = shapes[2][1]
        assert shapes[:4] == [(6,), (6,), (6, width), (6,)]  # and the host's ids, where it has them
    else:
        assert not made


def test_views_cut_one_array_into_its_parts():
    import mlx.core as mx

    from harness.program.batch_forward import views

    flat = np.arange(14, dtype=np.int32)
    a, b, c = views(flat, [(3,), (2, 4), (3,)])
    assert np.array(a).tolist() == [0, 1, 2] and np.array(b).tolist() == [[3, 4, 5, 6], [7, 8, 9, 10]]
    assert np.array(c).tolist() == [11, 12, 13] and a.dtype == mx.int32


def test_device_inputs_advance_as_the_host_would(models):
    """serve_device_inputs: a decode step whose sequences each moved on one token over the same
    tables makes its positions, slots and lengths on the device from the last step's, equal to the
    host's (decode_slots); a changed table, or a sequence that did not move on, takes the host's."""
    import mlx.core as mx

    from harness.program.batch_forward import decode_slots

    forward, _, work, _ = _six_decoding(models["tiny-qwen3"], 3, "fused")
    starts = np.array([w.start for w in work], np.int32)
    table = forward._table(work, 4)
    slots = decode_slots(work, table, starts, 16)
    forward._last_inputs = (starts, table, [mx.array(starts), mx.array(slots), mx.array(table), mx.array(starts + 1)])
    moved = [Work(w.request, w.tokens, w.start + 1, w.table, []) for w in work]
    after = starts + 1
    positions, got_slots, got_table, lens = forward._advanced(after, table.copy())
    assert np.array(positions).tolist() == after.tolist() and np.array(lens).tolist() == (after + 1).tolist()
    assert np.array(got_slots).tolist() == decode_slots(moved, table, after, 16).tolist()
    assert np.array(got_table).tolist() == table.tolist()
    grown = table.copy()
    grown[0, 1] = 7
    assert forward._advanced(after, grown) is None
    assert forward._advanced(starts, table) is None
    assert forward._advanced(after[:5], table[:5]) is None
