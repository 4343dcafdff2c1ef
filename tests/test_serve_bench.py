"""`lathe serve` (harness.serve_bench) on the CPU: workloads as described, a run's measures, rows
that serve.csv takes, llama-batched-bench's output read and paired by batch and round, a failing
variant recorded in its rows while the others go on."""

from __future__ import annotations

import numpy as np
import pytest

from harness.peers import PeerError, parse_batched
from harness.plots import serve_plot
from harness.program.batch_forward import make_batch_forward
from harness.program.decode import ReferenceDecoder, generate
from harness.program.models import load_gguf, write_random_gguf
from harness.results import append_rows, read_results
from harness.serve_bench import Workload, run_matrix, serve


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_random_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf", "tiny-llama", "q8_0", seed=3)
    return path, load_gguf(path)


def test_a_workload_is_what_it_says():
    reqs = Workload(6, 20, 9, shared=12, seed=4).requests(500)
    assert [len(r.prompt) for r in reqs] == [20] * 6 and [r.max_new for r in reqs] == [9] * 6
    assert all(r.prompt[:12] == reqs[0].prompt[:12] for r in reqs) and len({tuple(r.prompt) for r in reqs}) == 6
    assert all(r.arrival == 0 for r in reqs)
    mixed = Workload(50, 20, 9, shared=4, mixed=True, seed=4).requests(500)
    assert all(10 <= len(r.prompt) <= 20 and 5 <= r.max_new <= 9 and 0 <= r.arrival < 4 for r in mixed)
    assert len({len(r.prompt) for r in mixed}) > 3 and len({r.arrival for r in mixed}) > 1
    assert [r.prompt for r in mixed] == [r.prompt for r in Workload(50, 20, 9, 4, True, 4).requests(500)]
    with pytest.raises(ValueError, match="shared must be in 0..prompt-1"):
        Workload(2, 8, 4, shared=8)


def test_a_run_measures_its_steps(tiny):
    path, model = tiny
    w = Workload(4, 10, 6, seed=1)
    pool = w.pool(block_size=4)
    served = serve(make_batch_forward(model, "reference", pool, 16), pool, w.requests(model.config.vocab), 4)
    s = served.summary()
    assert s["generated"] == 24 and s["steps"] == 6  # one prefill step, five that decode all four
    assert s["prefill_tok_s"] > 0 and s["decode_tok_s"] > 0 and s["tok_s"] > 0 and s["preempted"] == 0
    assert 0 < s["ttft_ms_median"] <= s["ttft_ms_p99"] <= s["seconds"] * 1e3
    assert 0 < s["tpot_ms_median"] <= s["tpot_ms_p99"]
    assert s["occupancy_max"] == 1.0 and 0 < s["occupancy_mean"] <= 1.0 and pool.free_blocks == pool.num_blocks
    for r in served.requests:
        assert r.output == generate(ReferenceDecoder(model, 64), r.prompt, 6).generated


def test_a_megafused_run_counts_its_steps_in_the_batch_form(tiny):
    """mega_steps: the share of decode-only steps a megafused forward ran in token_block's batch
    form (its runs_mega at the step's batch), not fused's plan; none for another variant."""
    path, model = tiny
    w = Workload(6, 10, 8, mixed=True, seed=2)  # sequences start and stop at their own steps
    pool = w.pool(block_size=4)
    inner = make_batch_forward(model, "reference", pool, 16)
    decode_batches = []

    class Megafused:  # the reference's tokens, with megafused's plan choice: the batch form up to 3
        mega, lag = True, 0

        @staticmethod
        def runs_mega(t):
            return t <= 3

        def __call__(self, work):
            if all(not x.prefill for x in work):
                decode_batches.append(len(work))
            return inner(work)

    s = serve(Megafused(), pool, w.requests(model.config.vocab), 6).summary()
    assert len(set(decode_batches)) > 1
    assert s["mega_steps"] == pytest.approx(np.mean([t <= 3 for t in decode_batches]))
    assert serve(inner, pool, w.requests(model.config.vocab), 6).summary()["mega_steps"] is None


def test_a_pipelined_run_times_each_token_from_when_it_is_read():
    """Pipelined (lag 1), a step's tokens are read at the end of the next step: time to first
    token and per output token count from there, the last step's from the end of the run; a
    decode step's window right after a prompt's holds the prompt's GPU time, and decode tok/s
    leaves it out."""
    from harness.program.serve import Request
    from harness.serve_bench import Served

    r = Request(0, [1, 2], max_new=3)
    r.output, r.first_token_step, r.finished_step = [5, 6, 7], 1, 3
    steps = [(0.0, 1.0, 2, 2, False), (1.0, 2.0, 0, 1, True), (2.0, 4.0, 0, 1, True)]
    now = Served([r], steps, [0.5] * 3).summary()
    late = Served([r], steps, [0.5] * 3, lag=1).summary()
    assert now["ttft_ms_median"] == 1000.0 and now["tpot_ms_median"] == 1500.0  # (4 - 1) / 2
    assert late["ttft_ms_median"] == 2000.0 and late["tpot_ms_median"] == 1000.0  # (4 - 2) / 2
    # the first decode step's window held the prompt's GPU time, pipelined: decode tok/s leaves it out
    assert now["decode_tok_s"] == 2 / 3.0 and late["decode_tok_s"] == 1 / 2.0


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_pipelined_run_gives_the_tokens_of_one_that_is_not(tiny, pipelined):
    from harness.program.batch_forward import DeviceToken
    from kernels import options

    path, model = tiny
    w = Workload(3, 9, 7, seed=2)
    with options.use(serve_pipelined=pipelined):
        pool = w.pool(block_size=4)
        forward = make_batch_forward(model, "reference", pool, 16)
        assert forward.lag == int(pipelined)
        served = serve(forward, pool, w.requests(model.config.vocab), 3)
    assert served.lag == int(pipelined) and pool.free_blocks == pool.num_blocks
    for r in served.requests:  # settled: ints, whichever way they came
        assert all(type(t) is int for t in r.output) and not any(isinstance(t, DeviceToken) for t in r.output)
        assert r.output == generate(ReferenceDecoder(model, 64), r.prompt, 7).generated


JSONL = """build: 7000 (0c1e570) with cc
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99, "n_threads": 8, "n_threads_batch": 8, "pp": 16, "tg": 8, "pl": 1, "n_kv": 24, "t_pp": 0.01, "speed_pp": 1600.0, "t_tg": 0.04, "speed_tg": 200.0, "t": 0.05, "speed": 480.0}
llama_perf_context_print: noise
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99, "n_threads": 8, "n_threads_batch": 8, "pp": 16, "tg": 8, "pl": 4, "n_kv": 96, "t_pp": 0.02, "speed_pp": 3200.0, "t_tg": 0.05, "speed_tg": 640.0, "t": 0.07, "speed": 1371.4}
"""


def test_llama_batched_bench_output_is_read_by_batch():
    tests = parse_batched(JSONL, [4, 1])
    assert [t["pl"] for t in tests] == [4, 1] and tests[0]["speed_tg"] == 640.0
    with pytest.raises(PeerError, match=r"no result for batch \[8\]"):
        parse_batched(JSONL, [1, 8])


class FakePeer:
    build = "0c1e570 (7000)"

    def __init__(self):
        self.calls = []

    def run(self, path, prompt, gen, batches):
        self.calls.append((prompt, gen, tuple(batches)))
        return parse_batched(JSONL, batches)


def test_the_matrix_pairs_each_round_with_its_peer_and_records_a_failing_variant(tiny, tmp_path):
    path, model = tiny
    peer = FakePeer()
    common = dict(kernel="tiny", backend="cpu", device="cpu", peak_gbs=None, mlx_version="x", git_sha="abc",
                  date="2026-11-27T00:00:00Z", options="", model="tiny", qtype="Q8_0")
    rows = run_matrix(path, model, [Workload(1, 16, 8), Workload(4, 16, 8)], ["reference", "nonesuch"], 2, common,
                      peer)
    assert peer.calls == [(16, 8, (1, 4))] * 2
    ours = [r for r in rows if r["variant"] == "reference"]
    assert len(ours) == 4 and all(r["x_llama_cpp"] == round(r["decode_tok_s"] / {1: 200.0, 4: 640.0}[r["batch"]], 3)
                                  for r in ours)
    failed = [r for r in rows if r["variant"] == "nonesuch"]
    assert len(failed) == 4 and all("has no batched forward" in r["error"] and r["decode_tok_s"] is None for r in failed)
    csv = append_rows(tmp_path / "serve.csv", "serve", rows)
    df = read_results(csv)
    assert len(df) == 12 and set(df.variant) == {"reference", "nonesuch", "llama.cpp"}
    assert serve_plot(df, tmp_path / "serve.png", "test").stat().st_size > 0


def test_the_matrix_serves_each_variant_under_each_option_set(tiny, monkeypatch):
    """run_matrix's arms (serve's --ab): each round serves the variant under every set in turn, the
    set in force while it runs and named in its rows' options column; the run's own options after."""
    import harness.serve_bench as sb
    from kernels import options

    path, model = tiny
    seen = []
    real = sb.serve

    def spy(forward, pool, requests, batch):
        seen.append(options.get("serve_mega_rows"))
        return real(forward, pool, requests, batch)

    monkeypatch.setattr(sb, "serve", spy)
    common = dict(kernel="tiny", backend="cpu", device="cpu", peak_gbs=None, mlx_version="x", git_sha="abc",
                  date="2026-11-27T00:00:00Z", options="", model="tiny", qtype="Q8_0")
    arms = [{}, options.parse("serve_mega_rows=2")]
    rows = run_matrix(path, model, [Workload(2, 8, 3)], ["reference"], 2, common, None, arms)
    assert seen == [8, 8, 2, 2] * 2  # a warm-up and a timed serve a set, the sets in turn, each round
    assert [r["options"] for r in rows] == ["", "serve_mega_rows=2"] * 2
    assert [r["round"] for r in rows] == [1, 1, 2, 2] and not any(r.get("error") for r in rows)
    assert options.get("serve_mega_rows") == 8
