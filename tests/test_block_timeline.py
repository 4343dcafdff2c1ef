"""token_block's timeline (harness.tools.block_timeline): the stamps' arithmetic on made-up tickets
(CPU), and on the GPU a stamped launch that computes what an unstamped one does, its tickets in
phase order."""

from __future__ import annotations

import numpy as np
import pytest

from harness.tools.block_timeline import (IN_TIME, INSIDE, _signed, align, attention_inside, by_kind, launch_edges,
                                          phase_rows, phase_table, timer_step)

CLOCK_GHZ = 1.98


def _made_up(kinds, tickets, step_ns=1000, lag=700.0, seed=0):
    """True times of made-up tickets (ns from 0) and their stamps as the kernel writes them: a timer
    moving in steps of `step_ns` from near 2^32 (so that it wraps), two SMs whose cycle counters
    start apart (one wraps too)."""
    rng = np.random.default_rng(seed)
    rows, start = [], 0.0
    for n in tickets:
        claim = start - 900 + rng.uniform(0, 400, n)
        let_go = start + rng.uniform(0, 300, n)
        done = let_go + rng.uniform(800, 2500, n)
        rows.append(np.stack([claim, let_go, done], axis=1))
        start = done.max() + lag
    true = np.concatenate(rows)
    true -= true.min()
    sms = rng.integers(0, 2, true.shape[0])
    timer = np.floor((true + (1 << 32) - 5_000) / step_ns) * step_ns
    cycles = true * CLOCK_GHZ + np.where(sms == 0, 123_456.0, (1 << 32) - 2_000.0)[:, None]
    stamps = np.zeros((true.shape[0], 3, 3), np.uint32)
    stamps[:, :, 0] = (timer.astype(np.int64) % (1 << 32)).astype(np.uint32)
    stamps[:, :, 1] = (np.floor(cycles).astype(np.int64) % (1 << 32)).astype(np.uint32)
    stamps[:, :, 2] = sms[:, None]
    return true, stamps


KINDS = tuple(j % 5 for j in range(10))  # two layers
TICKETS = (40, 8, 24, 60, 30, 40, 8, 24, 60, 30)


def test_a_coarse_timer_is_refined_by_each_sms_cycles():
    true, stamps = _made_up(KINDS, TICKETS, step_ns=1000)
    ns, info = align(stamps)
    assert info["timer_step_ns"] == 1000 and info["aligned_by"].startswith("cycles")
    # one axis for both SMs, to well under the timer's step (its floor is the error of one reading)
    assert np.abs((ns - ns.min()) - (true - true.min())).max() < 100


def test_a_fine_timer_is_taken_as_it_is():
    true, stamps = _made_up(KINDS, TICKETS, step_ns=1)
    ns, info = align(stamps)
    assert info["aligned_by"] == "globaltimer"
    assert np.abs(ns - np.floor(true)).max() <= 1


def test_phases_split_the_launch_and_their_spans_add_up():
    true, _ = _made_up(KINDS, TICKETS, lag=700.0)
    table = phase_table(true, KINDS, TICKETS)
    assert [p["kind"] for p in table] == ["QKV", "ATTN", "O", "UP", "DOWN"] * 2
    assert [p["layer"] for p in table] == [0] * 5 + [1] * 5
    assert sum(p["span_us"] for p in table) == pytest.approx(true[:, 2].max() / 1e3)
    for j, (p, rows) in enumerate(zip(table, phase_rows(TICKETS))):
        assert p["tickets"] == TICKETS[j]
        assert p["body_us"] == pytest.approx((true[rows, 2].max() - true[rows, 1].min()) / 1e3)
        if j:  # every let-go of a made-up phase is 0..300 ns past its start, lag ns after the last done
            assert 0.7 <= p["lag_us"] <= p["start_us"] <= 1.0
    kinds = by_kind(table, {"UP": 2e6}, peak_gbs=4000.0)
    up = next(k for k in kinds if k["kind"] == "UP")
    assert up["phases"] == 2 and up["gbs"] == pytest.approx(2e6 / (up["span_us"] * 1e3))
    assert sum(k["share"] for k in kinds) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="tickets"):
        phase_table(true[:-1], KINDS, TICKETS)


def test_the_timer_step_is_its_smallest_move():
    assert timer_step(np.array([0.0, 1000.0, 1000.0, 3000.0])) == 1000.0
    with pytest.raises(ValueError, match=r"\[tickets, 3 or 6, 3\]"):
        align(np.zeros((4, 3), np.uint32))
    with pytest.raises(ValueError, match=r"\[tickets, 3 or 6, 3\]"):
        align(np.zeros((4, 4, 3), np.uint32))


def test_an_attention_tickets_marks_split_its_work():
    """The marks inside an attention ticket (stamps 3-5, taken between let go and done) split its
    work into INSIDE's intervals, over the attention phases' tickets only; they add up to its work.
    A made-up coarse timer is refined into them as into the others (six stamps a row)."""
    true3, _ = _made_up(KINDS, TICKETS, step_ns=1)
    rng = np.random.default_rng(4)
    work = true3[:, 2] - true3[:, 1]
    cuts = np.sort(rng.uniform(0.05, 0.95, (true3.shape[0], 3)), axis=1)
    true = np.concatenate([true3, true3[:, 1:2] + cuts * work[:, None]], axis=1)  # columns 0, 1, 2, 3, 4, 5
    inside = attention_inside(true, KINDS, TICKETS)
    attn = np.concatenate([true[r] for k, r in zip(KINDS, phase_rows(TICKETS)) if k == 1])
    assert set(inside) == set(INSIDE) and all(v.size == attn.shape[0] for v in inside.values())
    assert np.allclose(sum(inside.values()), attn[:, 2] - attn[:, 1])
    assert np.allclose(inside["query"], attn[:, 3] - attn[:, 1])
    assert np.allclose(inside["out"], attn[:, 2] - attn[:, 5])
    assert attention_inside(true3, KINDS, TICKETS) == {}  # three stamps a row: no marks
    assert list(IN_TIME) == [0, 1, 3, 4, 5, 2]


def test_only_attention_tickets_mark_inside_and_the_others_rows_are_filled():
    """The GEMV tickets leave stamps 3-5 unwritten (garbage here); BlockTimeline.array gives them
    their third stamp, and keeps the attention tickets' own marks."""
    import mlx.core as mx

    from kernels.blocks import ATTN, TIMELINE_STAMPS, BlockTimeline

    kinds, tickets = (0, ATTN, 2), (3, 2, 4)
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 2**32, (sum(tickets), TIMELINE_STAMPS, 3), dtype=np.uint32)
    got = BlockTimeline(mx.array(raw), kinds, tickets).array()
    attn = phase_rows(tickets)[1]
    others = np.r_[0:3, 5:9]
    assert (got[attn] == raw[attn]).all()
    assert (got[others, :3] == raw[others, :3]).all()
    assert all((got[others, i] == raw[others, 2]).all() for i in (3, 4, 5))
    three = raw[:, :3].copy()  # no marks (block_timeline_marks off): the rows as stamped
    assert (BlockTimeline(mx.array(three), kinds, tickets).array() == three).all()


def test_the_launch_edges_are_the_threadgroups_start_and_exit_around_the_tickets():
    """launch_edges on made-up stamps near the timer's wrap: the first threadgroup starts 3 us
    before the first claim, the last leaves 5 us after the last ticket's stamp (a ticket's stamp
    past the first's claim, not its row 0), the starts spread over 2 us, their life 28 us; no group
    rows: nothing."""
    base = 2**32 - 4_000  # the timer wraps between the stamps
    tickets = np.zeros((3, 3, 3), np.uint32)
    tickets[:, :, 0] = (base + np.array([[0, 500, 900], [100, 1_000, 20_000], [50, 300, 400]])) % 2**32
    groups = np.zeros((2, 3, 3), np.uint32)
    groups[:, :, 0] = (base + np.array([[-3_000, 20_100, 25_000], [-1_000, 20_050, 20_060]])) % 2**32
    assert launch_edges(tickets, groups) == pytest.approx({"before": 3.0, "after": 5.0, "starts": 2.0, "groups": 28.0})
    assert launch_edges(tickets, groups[:0]) == {}


def test_the_time_outside_the_stamps_is_taken_launch_by_launch():
    """outside_stamps: each launch's GPU time less its own stamps' span, the median of those (one
    launch 200 us past its span, the others 4: 4); where the trace lost a launch, the medians'
    difference."""
    from harness.tools.block_timeline import outside_stamps

    stamped = [1300.0, 1550.0, 1320.0, 1540.0, 1310.0]
    launches = [t + 4.0 for t in stamped]
    launches[2] += 196.0
    assert outside_stamps(launches, stamped) == pytest.approx(4.0)
    assert outside_stamps([1454.0, 1464.0, 1474.0], [1300.0, 1310.0, 1320.0, 1540.0]) == pytest.approx(1464 - 1315)


@pytest.mark.gpu
@pytest.mark.parametrize("marks", [False, True])
def test_a_stamped_token_block_computes_what_an_unstamped_one_does(tmp_path, marks):
    """A megafused step with its tickets stamped gives the logits of one without, and its stamps
    are those of a launch whose phases wait for each other: each ticket let go after its claim and
    done after that (with block_timeline_marks, the attention's marks between), and no phase's
    ticket let go before the phase before it was done."""
    import mlx.core as mx

    from harness.program.kernel_decode import KernelDecoder
    from harness.program.models import load_gguf, write_random_gguf
    from kernels import options
    from reference import rel_err

    model = load_gguf(write_random_gguf(tmp_path / "tiny-qwen3.gguf", "tiny-qwen3", "q8_0", seed=3))
    prompt = np.random.default_rng(1).integers(0, model.config.vocab, 16)
    logits = []
    with options.use(block_timeline_marks=marks):
        for stamped in (False, True):
            d = KernelDecoder(model, 32, "megafused")
            token = d.greedy(d.forward(prompt))
            d.timeline = [] if stamped else None
            logits.append(np.array(d.forward(token).astype(mx.float32)))
            if stamped:
                (tl,) = d.timeline
    assert rel_err(logits[1], logits[0]) < 1e-6
    stamps = tl.array()
    order = list(IN_TIME) if marks else [0, 1, 2]
    assert stamps.shape == (sum(tl.tickets), len(order), 3) and len(tl.kinds) == 5 * model.config.n_layers
    ns, info = align(stamps)
    slack = 2 * info["fit_rms_ns"] + 64  # the alignment's own error across SMs
    assert (np.diff(ns[:, order], axis=1) >= -slack).all()  # each row's stamps in the order taken
    inside = attention_inside(ns, tl.kinds, tl.tickets)
    assert (set(inside) == set(INSIDE) and all((v >= -slack).all() for v in inside.values())) if marks else not inside
    for before, after in zip(phase_rows(tl.tickets)[:-1], phase_rows(tl.tickets)[1:]):
        assert ns[after, 1].min() >= ns[before, 2].max() - slack
    table = phase_table(ns, tl.kinds, tl.tickets)
    assert sum(p["span_us"] for p in table) == pytest.approx(ns[:, 2].max() / 1e3)
    # each threadgroup's own row: started, out of its claims, gone, in that order; the tickets inside
    groups = tl.group_stamps()
    assert groups.shape == (tl.groups, 3, 3) and tl.groups > 0
    g = _signed(groups[:, :, 0], stamps[0, 0, 0])
    assert (np.diff(g, axis=1) >= 0).all()
    edges = launch_edges(stamps, groups)
    assert edges["before"] >= 0 and edges["after"] >= 0 and edges["starts"] >= 0


def test_a_batch_step_is_one_stamped_token_block_launch_over_the_paged_pool(tmp_path, monkeypatch):
    """--batch (launches recorded, the CUDA path stood in): BatchSteps prefills each sequence
    alone, then a stamped step of all of them is one token_block launch of the batch form (paged,
    a timeline), each sequence at its own next position; past serve_mega_rows (a step of several
    launches) or past serve_mega_extra (a step on fused's plan) it is refused."""
    from harness.program.models import load_gguf, write_random_gguf
    from harness.tools.block_timeline import BatchSteps
    from kernels import backends, options
    from kernels.runtime import recording

    monkeypatch.setattr(backends, "cross_group_waits", lambda: True)
    model = load_gguf(write_random_gguf(tmp_path / "tiny-qwen3.gguf", "tiny-qwen3", "q8_0", seed=3))
    with recording() as rec:
        seqs = BatchSteps(model, 3, 5, 64)
        assert seqs.pos == 5
        done = len(rec.jobs)
        seqs.timeline = []
        seqs.step()
    (tl,) = seqs.timeline
    stamped = [j for j in rec.jobs[done:] if j.spec.name.startswith("lathe_token_block")]
    assert len(stamped) == 1 and "_paged" in stamped[0].spec.name and stamped[0].spec.name.endswith("_timeline3")
    assert np.array(dict(zip(stamped[0].spec.inputs, stamped[0].inputs))["pos"]).tolist() == [5, 5, 5]
    assert len(tl.kinds) == 5 * model.config.n_layers and seqs.pos == 6
    with options.use(serve_mega_rows=2), pytest.raises(ValueError, match="one token_block launch"):
        BatchSteps(model, 3, 5, 64)
    with options.use(serve_mega_extra=0), recording(), pytest.raises(ValueError, match="runs fused's plan"):
        BatchSteps(model, 3, 5, 64)


def test_the_plain_modules_gpu_time_is_taken_with_the_stamps_off(monkeypatch):
    """plain_gpu_us: the stamps off, one step outside the trace (the plain module's compile), then
    `tokens` steps traced, and the median of their token_block launches only; None where there is
    no kernel trace (a CPU machine)."""
    import contextlib

    from harness.tools import block_timeline, gpu_trace

    class Steps:
        def __init__(self):
            self.timeline, self.log = [], []

        def step(self):
            self.log.append(("step", self.timeline, tracing[0]))

    tracing = [False]

    @contextlib.contextmanager
    def trace(save_to=None):
        kernels = []
        tracing[0] = True
        yield kernels
        tracing[0] = False
        kernels += [(0.0, 900.0 + i, "lathe_token_block_140_paged") for i in range(3)]
        kernels += [(0.0, 5000.0, "lathe_qmm_mma_head"), (0.0, 1.0, "lathe_argmax")]

    monkeypatch.setattr(gpu_trace, "available", lambda: False)
    steps = Steps()
    assert block_timeline.plain_gpu_us(steps, 3) is None and steps.log == [] and steps.timeline == []
    monkeypatch.setattr(gpu_trace, "available", lambda: True)
    monkeypatch.setattr(gpu_trace, "kernel_trace", trace)
    assert block_timeline.plain_gpu_us(steps, 3) == 901.0
    assert steps.log == [("step", None, False)] + [("step", None, True)] * 3
