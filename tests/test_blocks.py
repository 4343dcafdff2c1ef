"""The layer blocks (kernels.blocks): the stacked weights token_block reads and its argument checks,
all before any launch (CPU). The blocks' GPU checks are `lathe check blocks` (harness/suites/blocks.py),
run by tests/test_check_suites.py on a GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import blocks, gemv
from reference.quant import quantize

D, F, HQ, HKV, HD = 64, 96, 4, 2, 64


def _packed(n: int, k: int, seed: int, qtype: str = "q8_0") -> gemv.Packed:
    w = quantize(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), qtype)
    return gemv.repack(mx.array(w), qtype, n, k)


def test_a_stack_holds_every_layer_at_its_stride():
    """Layer l's bytes at l * stride (a multiple of 256, so every layer's 16-byte loads stay
    aligned), equal to the matrix it was made from; layer(l) is a view of them."""
    mats = [_packed(24, 64, seed) for seed in range(3)]  # 24 * 2 * 34 = 1632 bytes: padded
    stack = blocks.Stack(mats)
    assert stack.stride % blocks.STRIDE_ALIGN == 0 and stack.stride >= mats[0].data.size
    assert stack.data.shape == (3, stack.stride)  # a row a layer: MLX's dimensions are 32-bit
    data = np.array(stack.data).reshape(-1)
    for i, m in enumerate(mats):
        assert np.array_equal(data[i * stack.stride: i * stack.stride + m.data.size], np.array(m.data))
        assert np.array_equal(np.array(stack.layer(i).data), np.array(m.data))
        assert (stack.layer(i).n, stack.layer(i).k, stack.layer(i).qtype) == (24, 64, "q8_0")


def test_a_stack_takes_one_shape_and_type():
    with pytest.raises(ValueError, match="one block type and shape"):
        blocks.Stack([_packed(24, 64, 0), _packed(32, 64, 1)])
    with pytest.raises(ValueError, match="one block type and shape"):
        blocks.Stack([_packed(24, 64, 0), _packed(24, 64, 1, "q4_0")])
    with pytest.raises(ValueError, match="repacked"):
        blocks.Stack([mx.zeros((10,), mx.uint8)])


def _stacks(layers: int = 2) -> blocks.LayerStacks:
    n_qkv = (HQ + 2 * HKV) * HD
    norm = mx.ones((layers, D), mx.float16)
    return blocks.LayerStacks(norm, blocks.Stack([_packed(n_qkv, D, i) for i in range(layers)]),
                              blocks.Stack([_packed(D, HQ * HD, i) for i in range(layers)]), norm,
                              blocks.Stack([_packed(2 * F, D, i) for i in range(layers)]),
                              blocks.Stack([_packed(D, F, i) for i in range(layers)]))


def _token(stacks=None, caches=2, queue=None, x=None, norm=None):
    stacks = stacks or _stacks()
    if norm is not None:
        stacks.ffn_norm = norm
    kv = [mx.zeros((HKV, 16, HD), mx.float16) for _ in range(caches)]
    return blocks.token_block(mx.zeros((1, D), mx.float16) if x is None else x, stacks, 1e-6, "q8_0", kv, list(kv),
                              3, n_heads=HQ, queue=queue)


@pytest.mark.parametrize("call, message", [
    (lambda: _token(caches=1), "a K and a V cache for each of the 2 layers"),
    (lambda: _token(x=mx.zeros((2, D), mx.float16)), "one token"),
    (lambda: _token(norm=mx.ones((D,), mx.float16)), r"norms must be \[2, width\]"),
    (lambda: _token(queue=blocks.block_queue()), r"queue must be uint32 \[>= 704\]"),
])
def test_token_block_rejects_bad_arguments_before_launch(call, message):
    from kernels.runtime import recording

    with recording() as rec, pytest.raises(ValueError, match=message):
        call()
    assert not rec.jobs
