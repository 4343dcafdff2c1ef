"""harness.tools.profile_decode: the ncu CSV is cut into steps at the marker launches (CPU)."""

from __future__ import annotations

import pytest

from harness.tools import profile_decode

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def _row(i, name, unit, value):
    return (f'"{i}","1","python","h","{name}","1","7","(1,1,1)","(1,1,1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"\n')


def test_summarize_sums_the_last_complete_step(tmp_path, capsys):
    rows = [_row(0, "gemv(half*)", "usecond", "99"),  # before the first marker: not counted
            _row(1, "scan_kernel(float*)", "usecond", "2"),
            _row(2, "gemv(half*)", "usecond", "10.5"), _row(3, "gemv(half*)", "nsecond", "1,500"),
            _row(4, "scan_kernel(float*)", "usecond", "2"),
            _row(5, "rope(half*)", "us", "2.5"), _row(6, "rope(half*)", "ns", "500"),  # newer ncu
            _row(7, "scan_kernel(float*)", "usecond", "2")]
    path = tmp_path / "ncu.csv"
    path.write_text("==PROF== Connected to process\n" + HEAD + "".join(rows))
    profile_decode.summarize(path)
    out = capsys.readouterr().out
    assert "2 kernels, 0.003 ms" in out and "rope" in out and "gemv" not in out
    path.write_text(HEAD + "".join(rows[:4]))  # one marker: no complete step
    with pytest.raises(SystemExit, match="fewer than two"):
        profile_decode.summarize(path)


def _timeline(token: list[tuple[str, float]], tokens: int, start: float = 0.0) -> list:
    """(start, duration, name) of `tokens` repeats of `token`'s (name, us), 1 us apart."""
    kernels, t = [], start
    for _ in range(tokens):
        for name, d in token:
            kernels.append((t, d, name))
            t += d + 1.0
    return kernels


def test_timeline_cuts_tokens_at_the_argmax(capsys):
    # Three tokens of (embed 2 us, gemv 10 us, argmax 3 us), 1 us gaps; before the first argmax:
    # a partial token, not counted.
    token = [("lathe_embed(int*)", 2.0), ("gemv(half*)", 10.0),
             ("arg_reduce_general<float, ArgMax<float>>(float*)", 3.0)]
    kernels = [(0.0, 50.0, "gemv(half*)"), *_timeline(token, 3, start=60.0)]
    profile_decode.summarize_timeline(kernels)
    out = capsys.readouterr().out
    assert "over 2 tokens: GPU span 0.018 ms a token (median), kernels 0.015 ms, gaps 0.003 ms" in out
    assert out.index("gemv") < out.index("lathe_embed")  # by time a token
    profile_decode.summarize_timeline(kernels[:4])
    assert "too few" in capsys.readouterr().out
    # our argmax kernel ends a token as MLX's does
    ours = [*token[:2], ("custom_kernel_lathe_argmax_float16_t_32_t_4(__half const*)", 8.0)]
    profile_decode.summarize_timeline(_timeline(ours, 4))
    assert "over 3 tokens: GPU span 0.023 ms a token" in capsys.readouterr().out


def test_no_trace_without_a_cuda_backend():
    from harness.tools import gpu_trace
    from kernels.runtime import backend

    if backend() == "cuda":
        pytest.skip("a CUDA machine traces")
    assert not gpu_trace.available()
    with gpu_trace.kernel_trace() as kernels:
        pass
    assert kernels == []


def test_busy_time_counts_overlap_once():
    from harness.tools.gpu_trace import busy_us

    # [0, 10) and [5, 12) overlap; [20, 21) stands apart; [6, 8) lies inside the first
    assert busy_us([(5.0, 7.0, "b"), (0.0, 10.0, "a"), (20.0, 1.0, "c"), (6.0, 2.0, "d")]) == 13.0
    assert busy_us([]) == 0.0


def test_a_saved_trace_reads_back(tmp_path, capsys):
    import json

    from harness.tools import gpu_trace

    events = [{"cat": "kernel", "ts": 5.0, "dur": 1.0, "name": "b"},
              {"cat": "cpu_op", "ts": 0.0, "dur": 9.0, "name": "host"},
              {"cat": "kernel", "ts": 1.0, "dur": 2.0, "name": "a"}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert gpu_trace.read_trace(path) == [(1.0, 2.0, "a"), (5.0, 1.0, "b")]
    with pytest.raises(SystemExit):
        profile_decode.main(["--timeline", str(path), "--mode", "step"])
    assert "compiled-pipelined mode only" in capsys.readouterr().err


def test_timeline_by_position_in_the_layer(capsys):
    # Tokens of embed, 3 layers of (norm_gemv qkv 10 us, attention 5 us, norm_gemv gate_up 20 us),
    # the head (norm_gemv, 40 us) and the argmax: the two parts of norm_gemv come apart.
    layer = [("norm_gemv(half*)", 10.0), ("attention(half*)", 5.0), ("norm_gemv(half*)", 20.0)]
    token = [("embed(int*)", 2.0), *layer * 3, ("norm_gemv(half*)", 40.0),
             ("arg_reduce_general<ArgMax>(float*)", 3.0)]
    profile_decode.summarize_timeline(_timeline(token, 4))
    out = capsys.readouterr().out
    assert "by position over 3 tokens (3 layers of 3 kernels; medians)" in out
    assert "layer slot 0: norm_gemv" in out and "10.00 us" in out.split("layer slot 0")[1].splitlines()[0]
    assert "20.00 us" in out.split("layer slot 2")[1].splitlines()[0]
    assert "40.00 us" in out.split("token kernel 10: norm_gemv")[1].splitlines()[0]


def test_host_profile_keeps_the_tokens_and_names_the_frames(tmp_path, capsys):
    """harness.tools.host_profile on py-spy's raw format: the warm-up's compiling and other threads
    are left out, C++ names lose their template and argument lists, shares add up."""
    from harness.tools import host_profile

    loop = "main (harness/tools/profile_decode.py:300);run_pipelined (harness/tools/profile_decode.py:240)"
    queue = loop + ";run_pipelined.<locals>.queue (harness/tools/profile_decode.py:215)"
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        queue + ";mlx::core::async_eval (libmlx.so);mlx::core::eval_impl (libmlx.so);"
        "std::_Hash_bytes(void const*, unsigned long, unsigned long) (libstdc++.so) 3",
        queue + ";mlx::core::async_eval (libmlx.so);mlx::core::eval_impl (libmlx.so);"
        "mlx::core::cu::CommandEncoder::commit<int>(int) (libmlx.so) 1",
        loop + ";run_pipelined.<locals>.read (harness/tools/profile_decode.py:224);0x7f00 (libcuda.so) 4",
        queue + ";mlx::core::detail::compile_trace (libmlx.so) 50",   # the first token's tracing
        "worker (threading.py:10);pthread_cond_wait (libc.so.6) 70",  # another thread
    ]) + "\n")
    assert host_profile.frame_name("f<a<b>, c>(int) (libx.so)") == "f"
    assert host_profile.frame_name("0x7f00 (libcuda.so)") == "[libcuda.so]"
    host_profile.summarize(raw)
    out = capsys.readouterr().out
    assert "8 samples of the loop's tokens (50 that compiled or traced left out)" in out
    assert " 37.5%  std::_Hash_bytes" in out and " 50.0%  [libcuda.so]" in out
    assert "mlx::core::cu::CommandEncoder::commit\n" in out


def test_host_profile_of_serve_keeps_the_scheduler_steps(tmp_path, capsys):
    """A --serve profile (its file named host-serve-...) keeps the samples under serve_profile's
    timed steps, a step being the scheduler's; the prompts' admission before them is left out."""
    from harness.tools import host_profile

    steps = "main (harness/tools/serve_profile.py:150);profile_batch (harness/tools/serve_profile.py:90)"
    timed = steps + ";_decode_steps (harness/tools/serve_profile.py:75);Scheduler.step (harness/program/serve.py:120)"
    raw = tmp_path / "host-serve-qwen3-0.6b-fused-8.txt"
    raw.write_text("\n".join([
        timed + ";mlx::core::async_eval (libmlx.so);mlx::core::fast::CustomKernel::eval_gpu (libmlx.so) 6",
        timed + ";PagedBatchKernels._decode_step (harness/program/batch_forward.py:380) 2",
        steps + ";_admitted (harness/tools/serve_profile.py:50);Scheduler.step (harness/program/serve.py:120) 9",
    ]) + "\n")
    host_profile.summarize(raw)
    out = capsys.readouterr().out
    assert "8 samples of the loop's tokens" in out
    assert " 75.0%  mlx::core::fast::CustomKernel::eval_gpu" in out
    assert " 25.0%  PagedBatchKernels._decode_step (batch_forward.py)" in out


def test_prompt_timeline_spans_each_prompt_alone(capsys):
    # Three prompts of (embed 2 us, matmul 20 us, argmax 3 us), 1 us gaps, the host's 100 us
    # between them: a prompt's span is its own kernels and gaps only.
    prompt = [("lathe_embed(int*)", 2.0), ("gemm(half*)", 20.0), ("custom_kernel_lathe_argmax_half(half*)", 3.0)]
    kernels = [k for i in range(3) for k in _timeline(prompt, 1, start=200.0 * i)]
    profile_decode.summarize_prompt(kernels)
    out = capsys.readouterr().out
    assert "over 3 prompts: GPU span 0.027 ms a prompt (median), kernels 0.025 ms, gaps 0.002 ms; " \
           "3 kernels a prompt" in out
    assert out.index("gemm") < out.index("lathe_embed")  # by time a prompt
    profile_decode.summarize_prompt(kernels[:2])
    assert "no prompt to cut out" in capsys.readouterr().out


def test_prompt_profile_repeats_one_prompt_at_its_depth(capsys):
    # The reference variant (any backend): every timed prompt rewrites the same cache rows, so
    # each gives the token that the same depth and prompt give a fresh decoder.
    import mlx.core as mx
    import numpy as np

    from harness.program.decode import make_decoder, model_file
    from harness.program.models import load_gguf

    tokens = profile_decode.run_prompt("tiny-llama", "q8_0", "reference", 24, repeats=3, depth=8)
    out = capsys.readouterr().out
    assert "tiny-llama q8_0 reference prompt 24 at depth 8 (eager):" in out and "median of 3" in out
    assert all(f"{part} " in out for part in ("build", "encode", "wait"))
    model = load_gguf(model_file("tiny-llama", "q8_0"))
    rng = np.random.default_rng(0)
    depth, prompt = rng.integers(0, model.config.vocab, 8), rng.integers(0, model.config.vocab, 24)
    fresh = make_decoder(model, 8 + 24 + 1, "reference")
    mx.eval(fresh.forward(depth))
    assert tokens == [int(fresh.greedy(fresh.forward(prompt)).item())] * 3


def test_prompt_profile_times_the_prompt_as_the_mode_runs_it(capsys):
    # The compiled modes time the decoder's compiled prompt where it has one (as `lathe decode`
    # does), step mode its eager forward(); the label says which. A stand-in decoder records the
    # calls (the kernel variants need a GPU); the reference variant has no compiled prompt.
    import mlx.core as mx

    from kernels import options

    class Stand:
        class config:
            vocab = 50

        def __init__(self):
            self.pos, self.calls = 0, []

        def forward(self, ids, last_only=None):
            self.calls.append(("forward", self.pos, len(ids), last_only))
            return mx.zeros((1 if last_only else len(ids), 50))

        def compiled_forward(self, ids, last_only=None):
            self.calls.append(("compiled", self.pos, len(ids), last_only))
            return mx.zeros((1 if last_only else len(ids), 50))

        def greedy(self, logits):
            return mx.argmax(logits[-1:], axis=-1)

    for mode, how in (("compiled", "compiled"), ("compiled-pipelined", "compiled"), ("step", "forward")):
        stand = Stand()
        tokens = profile_decode._time_prompts(stand, "stand", 6, 3, 0, None, mode)
        # a warm-up, then 3, each asking for the last token's logits only (as generate() does)
        assert tokens == [0, 0, 0] and stand.calls == [(how, 0, 6, True)] * 4
        assert f"stand prompt 6 at depth 0 ({'compiled' if how == 'compiled' else 'eager'}):" in capsys.readouterr().out
    with options.use(prompt_compiled=False):
        stand = Stand()
        profile_decode._time_prompts(stand, "stand", 6, 2, 0, None, "compiled")
        assert {c[0] for c in stand.calls} == {"forward"} and "(eager)" in capsys.readouterr().out
    profile_decode.run_prompt("tiny-llama", "q8_0", "reference", 8, repeats=2, mode="compiled")
    assert "tiny-llama q8_0 reference prompt 8 at depth 0 (eager):" in capsys.readouterr().out


def test_prompt_profile_times_each_setting_on_a_decoder_of_its_own(capsys):
    # One model load, a decoder per option setting, each timed at the same depth and prompt.
    tokens = profile_decode.run_prompt("tiny-llama", "q8_0", "reference", 12, repeats=2, depth=4,
                                       settings=("", "prompt_logits=last,prompt_weights=f16"))
    out = capsys.readouterr().out
    assert out.count("tiny-llama q8_0 reference prompt 12 at depth 4 (eager):") == 2
    assert "options: defaults" in out and "options: prompt_logits=last,prompt_weights=f16" in out
    assert len(tokens) == 4 and len(set(tokens)) == 1


def test_host_profile_of_prompts_keeps_each_prompts_samples(tmp_path, capsys):
    """--prompt's raw file (record()'s name host-prompt...): the samples under a prompt's `once`."""
    from harness.tools import host_profile

    loop = "main (profile_decode.py:9);_time_prompts (profile_decode.py:350)"
    once = loop + ";_time_prompts.<locals>.once (profile_decode.py:340)"
    raw = tmp_path / "host-prompt16-qwen3-0.6b-fused.txt"
    raw.write_text("\n".join([
        once + ";mlx::core::async_eval (libmlx.so);mlx::core::cu::CommandEncoder::commit<int>(int) (libmlx.so) 3",
        once + ";forward (kernel_decode.py:1) 1",
        loop + ";print (builtins) 6",  # the timing's own report, outside a prompt
    ]) + "\n")
    host_profile.summarize(raw)
    out = capsys.readouterr().out
    assert "4 samples of the loop's tokens" in out and " 75.0%  mlx::core::cu::CommandEncoder::commit" in out
