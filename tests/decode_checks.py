"""Checks shared by the decode tests of the reference variant (tests/test_decode.py) and of the
kernel variants (tests/test_kernel_decode.py)."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np

from reference import rel_err
from reference.model import forward


def decodes_as_float64(decoder, model, prompt, steps: int) -> None:
    """The decoder's logits within 1e-2 of the float64 model's over a prompt and `steps` decode
    tokens (both follow the model's greedy path), and its greedy token the model's wherever the
    top-2 margin is clear: over half of the steps, so the check is not vacuous."""
    ours = np.array(decoder.forward(prompt))[-1]
    want, cache = forward(model, prompt)
    want = want[-1]
    compared = 0
    for _ in range(steps):
        assert rel_err(ours, want) <= 1e-2
        top2 = np.sort(want)[-2:]
        if (top2[1] - top2[0]) > 1e-2 * abs(top2[1]):
            assert int(np.argmax(ours)) == int(np.argmax(want))
            compared += 1
        token = int(np.argmax(want))
        ours = np.array(decoder.forward([token]))[-1]
        step, cache = forward(model, [token], cache)
        want = step[-1]
    assert compared > steps // 2


def wraps_like_the_window(decoder, model, prompt, mode: str, laps: int = 2) -> None:
    """Circular overflow: past max_seq a decode step overwrites the oldest row, so its logits
    must equal the float64 forward pass whose attention sees only the last max_seq positions
    (RoPE at absolute positions), `laps` times around the cache. mode "eager" goes through
    forward(), "compiled" through the decoder's compiled step (the position as an array)."""
    rows = decoder.max_seq
    fn = decoder.compiled_step() if mode == "compiled" else None
    ours = np.array(decoder.forward(prompt))[-1]
    want, cache = forward(model, prompt, window=rows)
    want = want[-1]
    for _ in range(laps * rows):
        assert rel_err(ours, want) <= 1e-2
        token = int(np.argmax(want))
        if fn is None:
            ours = np.array(decoder.forward([token]))[-1]
        else:
            logits, *caches = fn(mx.array([token], dtype=mx.int32), mx.array([decoder.pos], dtype=mx.int32),
                                 *decoder.cache_arrays())
            decoder.take_caches(caches)
            decoder.pos += 1
            ours = np.array(logits)[-1]
        step, cache = forward(model, [token], cache, window=rows)
        want = step[-1]
    assert rel_err(ours, want) <= 1e-2
    assert decoder.pos == len(prompt) + laps * rows
    # the window matters: without it the float64 pass differs by far more than the tolerance
    full = forward(model, [token], copy.deepcopy(cache))[0][-1]
    assert rel_err(full, forward(model, [token], copy.deepcopy(cache), window=rows)[0][-1]) > 1e-2
