"""The CLI on the CPU: it says plainly that no GPU backend is present and runs what can run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.runtime import has_gpu

ROOT = Path(__file__).resolve().parent.parent
cpu_only = pytest.mark.skipif(has_gpu(), reason="tests the CPU-only behaviour")


def lathe(*args: str) -> subprocess.CompletedProcess:
    import os
    import tempfile

    # Preset models are written into LATHE_CACHE: keep them out of the home directory.
    env = dict(os.environ, LATHE_CACHE=os.path.join(tempfile.gettempdir(), "lathe-test-cache"))
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


@cpu_only
@pytest.mark.parametrize("args", [("check",), ("check", "rope"), ("bench", "rope", "--no-write"), ()])
def test_commands_without_gpu_run_the_references(args):
    run = lathe(*args)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "NoGpuBackend" in run.stdout
    if args:  # a check or bench prints each case's row
        assert "reference.rope" in run.stdout and "0 failed" in run.stdout
    else:  # the main job: a summary line a family, and the reference decode
        assert re.search(r"rope +[1-9][0-9]* passed, 0 failed", run.stdout), run.stdout
        assert "tiny-llama" in run.stdout and "No GPU backend here" in run.stdout


@cpu_only
def test_peak_without_gpu():
    run = lathe("peak", "--no-write")
    assert run.returncode == 0 and "NoGpuBackend" in run.stdout


def test_decode_of_the_default_model():
    run = lathe("decode", "--gen", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tiny-llama" in run.stdout and "pp16+tg4" in run.stdout


def test_unknown_family_is_an_error():
    run = lathe("check", "nosuch")
    assert run.returncode != 0 and "unknown family" in run.stderr


def test_help_lists_the_commands():
    run = lathe("--help")
    assert run.returncode == 0
    for word in ("check", "bench", "peak"):
        assert word in run.stdout


def test_decode_writes_a_results_row(tmp_path, monkeypatch):
    """--write appends a decode.csv row in the decode schema (under a temporary root here)."""
    import harness.cli as cli
    from harness.results import columns, read_results

    monkeypatch.setenv("LATHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    assert cli.cmd_decode("tiny-qwen3", "q4_0", 8, 4, 0, "pipelined,compiled", repeat=2, depth=4,
                          write=True) == 0
    (csv,) = (tmp_path / "results").glob("*/decode.csv")
    df = read_results(csv)
    assert list(df.columns) == columns("decode")
    assert list(df["mode"]) == ["pipelined", "compiled"]  # one row per mode, in order
    for _, row in df.iterrows():
        assert (row.model, row.qtype, row.depth, row.prompt, row.gen) == ("tiny-qwen3", "q4_0", 4, 8, 4)
        assert row.decode_tok_s > 0 and row.bytes > 0 and row.us > 0
        assert row.repeats == 2 and 0 < row.us_min <= row.us <= row.us_max  # the repeats' spread
    assert csv.with_suffix(".png").stat().st_size > 0  # the tok/s plot drawn from the CSV


def test_decode_rejects_unknown_variants_and_modes():
    from harness.decode_bench import run_decode

    with pytest.raises(ValueError, match="mode must be among"):
        run_decode("tiny-llama", "q8_0", 4, 2, modes="step,warp")
    with pytest.raises(ValueError, match="variant must be among"):
        run_decode("tiny-llama", "q8_0", 4, 2, variants=("fastest",))
    with pytest.raises(ValueError, match="kv must be among"):
        run_decode("tiny-llama", "q8_0", 4, 2, kv="ring")
    with pytest.raises(ValueError, match="paged cache does not"):  # a paged pool grows by blocks
        run_decode("tiny-llama", "q8_0", 4, 8, variants="reference,fused", kv="contiguous,paged", ctx=6)
    with pytest.raises(ValueError, match="ctx must hold"):
        run_decode("tiny-llama", "q8_0", 4, 8, depth=4, ctx=6)
    # the reference variant has no paged cache: that pair is not run (nothing to time)
    assert run_decode("tiny-llama", "q8_0", 4, 2, kv="paged") == []


def test_decode_past_the_trained_context_only_when_asked():
    """A depth past the model's context (Llama-3-8B's 8192 at llama-bench's -d 16384) is an error,
    unless past_context allows it: then the decode runs there, as llama-bench's does."""
    from harness.decode_bench import run_decode

    with pytest.raises(ValueError, match="past it with past_context"):
        run_decode("tiny-llama", "q8_0", 4, 2, depth=1020)  # tiny-llama's context: 1024
    (row,) = run_decode("tiny-llama", "q8_0", 4, 2, depth=1020, past_context=True)
    assert (row["depth"], row["test"]) == (1020, "pp4+tg2 @ d1020") and row["decode_tok_s"] > 0


def test_decode_over_several_depths():
    """--depth 0,5 (as llama-bench's -d): one row per depth from one decoder, each timed after
    its own depth, the KV traffic growing with it; bad depth lists are clear errors."""
    from harness.decode_bench import run_decode

    rows = run_decode("tiny-llama", "q8_0", 4, 3, modes="step,compiled", depth="0,5")
    assert [(r["depth"], r["mode"]) for r in rows] == [(0, "step"), (0, "compiled"), (5, "step"), (5, "compiled")]
    assert rows[0]["kv_mb"] < rows[2]["kv_mb"] and rows[2]["test"] == "pp4+tg3 @ d5"
    assert all("round" not in r for r in rows)  # one round, no peer: nothing to tell apart
    for bad, match in (("0,x", "comma-separated numbers"), ("4,4", "distinct"), ("-1", "at least 0")):
        with pytest.raises(ValueError, match=match):
            run_decode("tiny-llama", "q8_0", 4, 3, depth=bad)
    with pytest.raises(ValueError, match="ctx must hold"):  # one given cache serves every depth
        run_decode("tiny-llama", "q8_0", 4, 3, depth="0,8", ctx=10)


def test_decode_arms_alternate_option_sets(monkeypatch):
    """--ab: each variant is timed under each option set in every round, the set in effect while
    it runs (and only then), and each row (and its decode.csv row) names its set."""
    from harness import decode_bench
    from kernels import options

    seen, timed = [], decode_bench._time_mode
    monkeypatch.setattr(decode_bench, "_time_mode",
                        lambda *a, **k: (seen.append(options.get("attn_partition")), timed(*a, **k))[1])
    before = options.describe()
    rows = decode_bench.run_decode("tiny-llama", "q8_0", 4, 2, rounds=2,
                                   arms=[{}, options.parse("attn_partition=128")])
    assert [(r["round"], r["options"]) for r in rows] == [(1, before), (1, "attn_partition=128"),
                                                          (2, before), (2, "attn_partition=128")]
    assert seen == [options.get("attn_partition"), 128] * 2 and options.describe() == before
    row = decode_bench.decode_row(rows[1], None, "cpu", dict(git_sha="x", options="ignored"))
    assert row["options"] == "attn_partition=128"


def test_traffic_counts_the_stored_weights(tmp_path, monkeypatch):
    """Weight bytes per token: every stored matrix once (one embedding row unless tied), so
    close to the file size; KV bytes grow with the position."""
    from harness.program.decode import model_file
    from harness.decode_bench import traffic
    from harness.program.models import load_gguf

    monkeypatch.setenv("LATHE_CACHE", str(tmp_path))
    path = model_file("tiny-llama", "q8_0")
    model = load_gguf(path)
    weights, kv0 = traffic(model, 0)
    _, kv10 = traffic(model, 10)
    c = model.config
    assert kv0 == 0 and kv10 == 10 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
    assert 0.5 * path.stat().st_size < weights <= path.stat().st_size


def test_decode_wraps_around_a_short_cache():
    """--ctx below prompt + gen: the decode goes past the cache (circular overflow) and the run
    is reported (the reference variant here; the kernel variants on the device)."""
    run = lathe("decode", "tiny-llama", "--prompt", "8", "--gen", "24", "--ctx", "12", "--no-write")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pp8+tg24" in run.stdout


def test_decode_show_plan():
    run = lathe("decode", "tiny-qwen3", "--show-plan")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "head_norm" in run.stdout and "steps per token" in run.stdout
    paged = lathe("decode", "tiny-qwen3", "--show-plan", "--variant", "fused", "--kv", "paged")
    assert paged.returncode == 0, paged.stdout + paged.stderr
    assert "rope_paged_kv_write" in paged.stdout and "paged_attention" in paged.stdout
    unfused = lathe("decode", "tiny-qwen3", "--show-plan", "--variant", "unfused", "--kv", "paged")
    assert unfused.returncode == 0 and "reshape_and_cache" in unfused.stdout


def _cut(path: Path, keep: int) -> Path:
    data = path.read_bytes()
    out = path.with_name(f"cut-{keep}.gguf")
    out.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    return out


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    from harness.program.models import write_random_gguf

    root = tmp_path_factory.mktemp("bad")
    good = write_random_gguf(root / "tiny.gguf", "tiny-llama", "q8_0")
    (root / "empty.gguf").write_bytes(b"")
    (root / "text.gguf").write_text("not a model\n")
    return {"missing": root / "nope.gguf", "empty": root / "empty.gguf", "text": root / "text.gguf",
            "cut data": _cut(good, 100_000), "cut end": _cut(good, -10), "cut header": _cut(good, 300)}


# A user's mistake, as a new user makes them: one line on stderr naming it, exit 2 (argparse's
# code), no traceback; --debug shows the traceback.
USER_ERRORS = [
    (("decode", "{missing}"), "neither a GGUF file nor a preset"),
    (("decode", "{empty}"), "not a GGUF file"),
    (("decode", "{text}"), "not a GGUF file"),
    (("decode", "{cut data}"), "truncated: tensor token_embd.weight ends at byte"),
    (("decode", "{cut end}"), "truncated: tensor blk.1.ffn_down.weight ends at byte"),
    (("decode", "{cut header}"), "truncated: the header ends early"),
    (("decode", "no-such-preset"), "neither a GGUF file nor a preset (tiny-llama"),
    (("decode", "tiny-llama", "--mode", "bogus"), "mode must be among"),
    (("decode", "tiny-llama", "--gen", "0"), "prompt and gen at least 1"),
    (("decode", "tiny-llama", "--ctx", "4"), "ctx must hold depth + prompt = 16 tokens"),
    (("decode", "tiny-llama", "--qtype", "q2_k"), "qtype must be one of"),
    (("decode", "tiny-llama", "--depth", "x"), "depth must be a number"),
    (("decode", "tiny-llama", "--set", "seams=maybe"), "option seams: expected on/off"),
    (("decode", "tiny-llama", "--set", "nosuch=1"), "unknown option 'nosuch'"),
    (("bench", "--set", "gemv_tuning=R=x"), "expected KEY=INT pairs"),
]


@pytest.mark.parametrize("args, said", USER_ERRORS, ids=[" ".join(a) for a, _ in USER_ERRORS])
def test_a_user_error_is_one_line_and_exit_2(bad_files, capsys, monkeypatch, tmp_path, args, said):
    from harness import cli

    monkeypatch.setenv("LATHE_CACHE", str(tmp_path))
    args = [a.format(**bad_files) for a in args]
    assert cli.main([*args, "--no-write"] if args[0] == "decode" else args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lathe: error: ") and said in err[0], err
    with pytest.raises(ValueError, match=re.escape(said.split(" (")[0])):
        cli.main([*args, "--debug"])


@cpu_only
def test_a_kernel_variant_without_a_gpu_is_one_line(capsys, monkeypatch, tmp_path):
    from harness import cli

    monkeypatch.setenv("LATHE_CACHE", str(tmp_path))
    assert cli.main(["decode", "tiny-llama", "--variant", "fused", "--gen", "2", "--no-write"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("lathe: error: NoGpuBackend:")


def test_options_are_listed_and_the_plan_names_those_set(capsys, monkeypatch, tmp_path):
    from harness import cli
    from kernels import options

    monkeypatch.setenv("LATHE_CACHE", str(tmp_path))
    assert cli.main(["options"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in options.OPTIONS)
    with options.use():  # main() sets process-wide options: put them back afterwards
        assert cli.main(["decode", "tiny-llama", "--show-plan", "--set", "seams=on,attn_partition=64"]) == 0
    assert capsys.readouterr().out.startswith("options: seams=on,attn_partition=64\n")


@cpu_only
def test_check_shards_split_the_cases_without_overlap():
    def cases(run):  # each passing row, its rel_err (fresh data), seconds and result left off
        return [" ".join(line.split()[:-3]) for line in run.stdout.splitlines() if line.endswith(" pass")]

    shards = [cases(lathe("check", "rope", "--shard", f"{i}/3")) for i in range(3)]
    whole = cases(lathe("check", "rope"))
    assert len(whole) >= 3 and all(shards)
    assert sorted(sum(shards, [])) == sorted(whole)


def test_compile_takes_one_of_metal_record_recorded():
    run = lathe("compile", "--record", "a.gz", "--recorded", "a.gz")
    assert run.returncode == 2 and "not allowed with argument" in run.stderr


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1", "a/b"])
def test_check_shard_spec_errors(spec):
    run = lathe("check", "rope", "--shard", spec)
    assert run.returncode == 2 and "--shard" in run.stderr


def test_a_failing_variant_is_a_row_and_the_matrix_goes_on(tmp_path, monkeypatch, capsys):
    """A variant that fails (here: a kernel variant without a GPU, or any exception) records its
    error in its rows, every round, and the other variants still run; `lathe decode` then says so
    and exits 1, having written what ran."""
    from harness import cli
    from harness.decode_bench import decode_row, run_decode
    from harness.results import append_rows, read_results

    monkeypatch.setenv("LATHE_CACHE", str(tmp_path))
    import harness.decode_bench as bench

    real = bench.make_decoder

    def broken(model, max_seq, variant="reference", *args, **kw):
        if variant == "unfused":
            raise RuntimeError("planted failure")
        return real(model, max_seq, variant, *args, **kw)

    monkeypatch.setattr(bench, "make_decoder", broken)
    rows = run_decode("tiny-llama", "q8_0", 4, 2, variants="unfused,reference", modes="step,compiled", rounds=2)
    by = {(r["variant"], r["mode"], r["round"]): r for r in rows}
    assert len(rows) == 8 and set(by) == {(v, m, n) for v in ("unfused", "reference")
                                          for m in ("step", "compiled") for n in (1, 2)}
    assert all(by[("unfused", m, n)]["error"] == "RuntimeError: planted failure" for m in ("step", "compiled")
               for n in (1, 2))
    assert all(by[("reference", m, n)]["decode_tok_s"] > 0 and not by[("reference", m, n)].get("error")
               for m in ("step", "compiled") for n in (1, 2))
    meta = dict(mlx_version="0", git_sha="x", date="d", options="")
    csv = append_rows(tmp_path / "decode.csv", "decode", [decode_row(r, None, "cpu", meta) for r in rows])
    assert read_results(csv).error.notna().sum() == 4
    assert cli.main(["decode", "tiny-llama", "--variant", "unfused,reference", "--no-write"]) == 1
    assert "unfused did not run" in capsys.readouterr().err


def test_serve_runs_a_batch_and_names_a_variant_it_cannot_run():
    run = lathe("serve", "tiny-llama", "--batch", "1,3", "--prompt", "8", "--gen", "4", "--no-write")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "decode_tok_s" in run.stdout and "ttft_ms_median" in run.stdout
    bad = lathe("serve", "tiny-llama", "--batch", "2", "--prompt", "8", "--gen", "4", "--variant", "reference,nonesuch",
                "--no-write")
    assert bad.returncode == 1 and "has no batched forward" in bad.stdout and "nonesuch did not run" in bad.stderr
