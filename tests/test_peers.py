"""llama.cpp timed by the workbench in the same run (harness.peers, `lathe decode --peer`), on the
CPU: llama-bench's JSON as a real build printed it, and a stand-in llama-bench for the CLI path
(CI has no llama.cpp build; the real one ran on the device, results/nvidia-h200/logs/peers-*.log)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import peers
from harness.results import columns, read_results

ROOT = Path(__file__).resolve().parent.parent
# `llama-bench -m tiny-llama-q8_0-seed0.gguf -p 16 -n 8 -d 0,8 -r 2 -fa 1 -o json` of a CPU build
# of llama.cpp 0c1e57098 (llama-cpp-python 0.3.36's sources; model_filename shortened).
REAL_JSON = ROOT / "tests" / "data" / "llama-bench-tiny-llama-cpu.json"


def _roofline(position, tok_s):
    return dict(weight_mb=1.0, kv_mb=position / 1e3, gbs=round(tok_s * 1e-3, 2), pct_roofline=None)


def test_a_real_llama_bench_output_becomes_one_row_per_depth():
    tests = peers.parse_tests(REAL_JSON.read_text())
    assert len(tests) == 4
    rows = peers.peer_rows(tests, 16, 8, [0, 8], dict(model="tiny-llama", qtype="q8_0", round=1), _roofline)
    assert [r["depth"] for r in rows] == [0, 8]
    d0, d8 = rows
    assert d0["decode_tok_s"] == 7275.7 and d0["prefill_tok_s"] == 25721.4  # tg8 and pp16 at depth 0
    assert d8["decode_tok_s"] == 7237.9 and d8["prefill_tok_s"] == 26932.6
    assert d0["ms_per_token_min"] == round(1e3 / 7349.55, 3) and d0["ms_per_token_max"] == round(1e3 / 7201.93, 3)
    assert d0["ms_per_token"] == round(1e3 / 7275.741197, 3)
    for r in rows:
        assert (r["variant"], r["mode"], r["backend"]) == ("llama.cpp", "llama-bench", "CPU")
        assert r["peer_build"] == "unknown (0)" and r["round"] == 1 and r["model"] == "tiny-llama"
        assert r["dispatches_per_token"] is None and r["compile_s"] is None
    assert d8["test"] == "pp16+tg8 @ d8" and d8["kv_mb"] == (8 + 3.5) / 1e3  # its own mean position


def test_missing_or_unreadable_tests_are_clear_errors():
    tests = peers.parse_tests(REAL_JSON.read_text())
    with pytest.raises(peers.PeerError, match="n_depth 4096"):
        peers.peer_rows(tests, 16, 8, [4096], {}, _roofline)
    with pytest.raises(peers.PeerError, match="not JSON"):
        peers.parse_tests("main: error: failed to load model\n")
    with pytest.raises(peers.PeerError, match="list of tests"):
        peers.parse_tests(json.dumps([{"n_prompt": 0}]))


def test_each_row_is_paired_with_the_peer_of_its_depth_and_round():
    rows = [dict(variant="fused", depth=0, round=1, decode_tok_s=300.0),
            dict(variant="llama.cpp", depth=0, round=1, decode_tok_s=250.0),
            dict(variant="fused", depth=0, round=2, decode_tok_s=320.0),
            dict(variant="llama.cpp", depth=0, round=2, decode_tok_s=200.0),
            dict(variant="fused", depth=64, round=2, decode_tok_s=100.0)]  # no peer at that depth
    peers.pair_with_peer(rows)
    assert [r["x_llama_cpp"] for r in rows] == [1.2, None, 1.6, None, None]


def test_llama_bench_is_found_on_path_or_by_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert peers.find_llama_bench() is None
    exe = _fake_llama_bench(tmp_path)
    assert peers.find_llama_bench() == str(exe)
    monkeypatch.setenv("LLAMA_BENCH", str(tmp_path / "nosuch"))
    with pytest.raises(peers.PeerError, match="not an executable"):
        peers.find_llama_bench()


def _fake_llama_bench(where: Path, fail: bool = False) -> Path:
    """A stand-in llama-bench: checks the arguments lathe must pass, records them, and prints
    llama-bench's JSON with tok/s that say which test they are (tg: 1000 + depth; pp: 5000)."""
    exe = where / "llama-bench"
    exe.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        a = sys.argv[1:]
        opt = dict(zip(a[::2], a[1::2]))
        assert len(a) == 2 * len(opt) and opt["-fa"] == "1" and opt["-o"] == "json", a
        with open({str(where / "calls.txt")!r}, "a") as f:
            f.write(" ".join(a) + "\\n")
        if {fail!r}:
            sys.exit("llama-bench: the model could not be loaded")
        tests = []
        for d in map(int, opt["-d"].split(",")):
            for p, n, ts in ((int(opt["-p"]), 0, 5000.0), (0, int(opt["-n"]), 1000.0 + d)):
                tests.append(dict(build_commit="fake123", build_number=7, backends="FAKE", n_prompt=p,
                                  n_gen=n, n_depth=d, avg_ts=ts, stddev_ts=0.0,
                                  samples_ts=[ts] * int(opt["-r"])))
        print(json.dumps(tests))
        """))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _lathe(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if k != "LLAMA_BENCH"}
    run_env.update(LATHE_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-c", "import sys, harness.cli as cli; cli.ROOT = sys.argv[1]; "
                           "sys.exit(cli.main(sys.argv[2:]))", str(tmp_path), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=run_env)


def test_decode_with_the_peer_alternates_and_divides_by_its_own_rows(tmp_path):
    exe = _fake_llama_bench(tmp_path)
    run = _lathe(tmp_path, "decode", "tiny-llama", "--prompt", "6", "--gen", "4", "--depth", "0,5",
                 "--mode", "step,compiled", "--peer", "llama.cpp", "--write", "--set", "prompt_logits=last",
                 LLAMA_BENCH=str(exe))
    assert run.returncode == 0, run.stdout + run.stderr
    (csv,) = (tmp_path / "results").glob("*/decode.csv")
    df = read_results(csv)
    assert list(df.columns) == columns("decode")
    # two rounds (the default with a peer): lathe's four rows, then llama.cpp's two, twice
    order = list(zip(df["round"], df.variant, df["mode"], df.depth))
    lathe = [(v, m, d) for d in (0, 5) for v, m in (("reference", "step"), ("reference", "compiled"))]
    peer = [("llama.cpp", "llama-bench", d) for d in (0, 5)]
    assert order == [(r, *row) for r in (1, 2) for row in lathe + peer]
    ours, theirs = df[df.variant == "reference"], df[df.variant == "llama.cpp"]
    assert (theirs.decode_tok_s == 1000 + theirs.depth).all() and (theirs.prefill_tok_s == 5000).all()
    assert (theirs.peer_build == "fake123 (7)").all() and (theirs.backend == "FAKE").all()
    assert theirs.x_llama_cpp.isna().all() and theirs.dispatches_per_token.isna().all()
    # lathe's options are recorded on its rows only: llama.cpp takes none of them
    assert (ours.options == "prompt_logits=last").all() and theirs.options.isna().all()
    # x_llama_cpp is rounded to 3 places with Python's round; the check rounds the same way
    # (NumPy's .round could land on the other side of a tie and failed about one run in three)
    want = [round(tok_s / (1000 + depth), 3) for tok_s, depth in zip(ours.decode_tok_s, ours.depth)]
    assert list(ours.x_llama_cpp) == want
    assert df.date.nunique() == 1 and df.git_sha.nunique() == 1  # one run
    # llama-bench got the very file lathe decoded, the same prompt, gen, depths and repeats
    model = tmp_path / "cache" / "models" / "tiny-llama-q8_0-seed0.gguf"
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == [f"-m {model} -p 6 -n 4 -d 0,5 -r 1 -fa 1 -o json"] * 2
    assert "x_llama_cpp" in run.stdout and "fake123 (7)" in run.stdout


def test_decode_without_llama_bench_says_how_to_get_one(tmp_path):
    run = _lathe(tmp_path, "decode", "tiny-llama", "--gen", "2", "--peer", "llama.cpp", "--no-write",
                 PATH=os.path.dirname(sys.executable))
    assert run.returncode == 0, run.stdout + run.stderr
    hint = [line for line in run.stderr.splitlines() if "llama-bench" in line]
    assert len(hint) == 1 and "no llama-bench found" in hint[0] and "LLAMA_BENCH" in hint[0]
    assert "x_llama_cpp" not in run.stdout  # no ratio without a peer measured in this run


def test_a_failing_peer_keeps_lathes_rows_and_fails_the_command(tmp_path):
    exe = _fake_llama_bench(tmp_path, fail=True)
    run = _lathe(tmp_path, "decode", "tiny-llama", "--gen", "2", "--peer", "llama.cpp", "--write",
                 LLAMA_BENCH=str(exe))
    assert run.returncode == 1
    assert "could not be loaded" in run.stderr and "ran in 0 of 2 rounds" in run.stderr
    df = read_results(next((tmp_path / "results").glob("*/decode.csv")))
    assert list(df.variant) == ["reference", "reference"]  # both rounds of ours, written
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 1  # not asked again
