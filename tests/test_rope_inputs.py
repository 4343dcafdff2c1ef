"""Bad input to the RoPE kernels: a clear ValueError before any launch (runs without a GPU, since
arguments are checked before the kernel is compiled or launched)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import kernels.rope as kr

D, HQ, HKV, MAX_SEQ = 64, 8, 2, 16


def h(*shape, dtype=mx.float16):
    return mx.zeros(shape, dtype=dtype)


def caches(n_kv=HKV, max_seq=MAX_SEQ, d=D):
    return h(n_kv, max_seq, d), h(n_kv, max_seq, d)


QKV = (HQ + 2 * HKV) * D


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kr.rope(h(3, HQ, D, dtype=mx.float32)), "float16"),
        (lambda: kr.rope(h(3, HQ, 63)), "multiple of 4"),
        (lambda: kr.head_rmsnorm(h(3, 63), h(63, dtype=mx.float32)), "multiple of 64"),
        (lambda: kr.rope(h(3, HQ * D)), r"\[seq, n_heads, head_dim\]"),
        (lambda: kr.rope(h(3, HQ, D), freqs="fast"), "freqs"),
        (lambda: kr.rope(h(3, HQ, D), -1), "pos must be >= 0"),
        (lambda: kr.rope_neox(h(3, HQ, D), position_ids=mx.zeros((3,), mx.float32)), "position_ids"),
        (lambda: kr.rope_neox(h(3, HQ, D), position_ids=mx.zeros((4,), mx.int32)), "position_ids"),
        (lambda: kr.rope(h(3, HQ, D), inv_freq=mx.zeros((D,), mx.float32)), "inv_freq"),
        (lambda: kr.rope_qkv_write(h(QKV), *caches(), 3, n_heads=HQ + 1), "multiple of n_kv_heads"),
        (lambda: kr.rope_qkv_write(h(QKV + D), *caches(), 3, n_heads=HQ), "qkv must be"),
        (lambda: kr.rope_qkv_write(h(QKV), *caches(), MAX_SEQ, n_heads=HQ), "beyond the cache"),
        (lambda: kr.rope_qkv_write(h(QKV), *caches(), 3, n_heads=HQ, form="lazy"), "form"),
        (lambda: kr.rope_qkv_write(h(QKV), h(HKV, MAX_SEQ, D), h(HKV, MAX_SEQ + 1, D), 3, n_heads=HQ),
         "differ in shape"),
        (lambda: kr.rope_qkv_write(h(QKV), h(HKV, MAX_SEQ, D, dtype=mx.float32), h(HKV, MAX_SEQ, D), 3,
                                   n_heads=HQ), "float16"),
        (lambda: kr.rope_qkv_write(h(QKV), h(HKV, MAX_SEQ, D, 1), h(HKV, MAX_SEQ, D), 3, n_heads=HQ),
         "k_cache must be"),
        (lambda: kr.rope_qkv_write(h(QKV), *caches(), mx.array([3], mx.float32), n_heads=HQ), "pos array"),
        (lambda: kr.rope_batch_kv_write(h(4, HQ * D), h(4, HKV * D), h(5, HKV * D), *caches(), 0),
         "v must be"),
        (lambda: kr.rope_batch_kv_write(h(4, HQ * D), h(4, 3 * D), h(4, HKV * D), *caches(), 0),
         "k must be"),
        (lambda: kr.rope_batch_kv_write(h(4, HQ * D + 1), h(4, HKV * D), h(4, HKV * D), *caches(), 0),
         "q must be"),
        (lambda: kr.rope_batch_kv_write(h(4, HQ * D), h(4, HKV * D), h(4, HKV * D), *caches(), 13),
         "beyond the cache"),
        (lambda: kr.rope_batch_kv_write(h(4, 3 * D), h(4, HKV * D), h(4, HKV * D), *caches(), 0),
         "multiple of n_kv_heads"),
        (lambda: kr.head_norm_rope_neox_kv_write(
            h(1, HQ * D), h(1, HKV * D), h(1, HKV * D), h(D, dtype=mx.float32), h(D), *caches(), 0),
         "k_norm must be float32"),
        (lambda: kr.head_norm_rope_neox_kv_write(
            h(1, HQ * 96), h(1, HKV * 96), h(1, HKV * 96), h(96, dtype=mx.float32),
            h(96, dtype=mx.float32), *caches(d=96), 0), "multiple of 64"),
        (lambda: kr.cache_write(h(2, HKV * D), h(HKV, MAX_SEQ, D), MAX_SEQ - 1), "beyond the cache"),
        (lambda: kr.cache_read(h(HKV, MAX_SEQ, D), MAX_SEQ - 2, 3, h(1)), "outside a cache"),
        (lambda: kr.rope(h(3, HQ, 66)), "multiple of 4"),
        (lambda: kr.head_rmsnorm(h(2, HQ, D), h(D)), "weight must be float32"),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_valid_call_without_gpu_says_no_gpu_backend():
    from kernels.runtime import NoGpuBackend, has_gpu

    if has_gpu():
        pytest.skip("a GPU backend is present")
    with pytest.raises(NoGpuBackend, match="references"):
        kr.rope(h(3, HQ, D))


def paged(blocks=4, n_kv=HKV, d=D, bs=16):
    return h(blocks, n_kv, d // 8, bs, 8), h(blocks, n_kv, d, bs)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *caches(), [0, 1, 2], [0, 1, 2]),
         "paged pool"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, 1, 2], [0, 1, 64]),
         r"slots must be in 0..63"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, -1, 2], [0, 1, 2]),
         "positions must be in"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, 1], [0, 1, 2]),
         "3 tokens but 2 positions"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, 1, 2],
                                        mx.zeros((3,), mx.uint32)), r"slots must be int32\[3\]"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(2, HKV * D), h(3, HKV * D), *paged(), [0, 1, 2], [0, 1, 2]),
         r"k must be \[3, 2 \* 64\]"),
        (lambda: kr.rope_paged_kv_write(h(3, 7 * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, 1, 2], [0, 1, 2]),
         "heads"),
        # Qwen3's head norms: both weights, NeoX, float32 [D], D a multiple of 64
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, 1, 2], [0, 1, 2],
                                        neox=True, q_norm=mx.ones((D,))), "both q_norm and k_norm"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, 1, 2], [0, 1, 2],
                                        q_norm=mx.ones((D,)), k_norm=mx.ones((D,))), "NeoX"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * D), h(3, HKV * D), h(3, HKV * D), *paged(), [0, 1, 2], [0, 1, 2],
                                        neox=True, q_norm=h(D), k_norm=mx.ones((D,))), r"q_norm must be float32\[64\]"),
        (lambda: kr.rope_paged_kv_write(h(3, HQ * 32), h(3, HKV * 32), h(3, HKV * 32), *paged(d=32), [0, 1, 2],
                                        [0, 1, 2], neox=True, q_norm=mx.ones((32,)), k_norm=mx.ones((32,))),
         "multiple of 64"),
    ],
)
def test_rope_paged_kv_write_refuses_before_launch(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kr.rope_paged_qkv_write(h(3, (HQ + 2 * HKV) * D), *caches(), [0, 1, 2], [0, 1, 2], n_heads=HQ),
         "paged pool"),
        (lambda: kr.rope_paged_qkv_write(h(3, (HQ + HKV) * D), *paged(), [0, 1, 2], [0, 1, 2], n_heads=HQ),
         "qkv must be"),
        (lambda: kr.rope_paged_qkv_write(h(3, (7 + 2 * HKV) * D), *paged(), [0, 1, 2], [0, 1, 2], n_heads=7),
         "heads"),
        (lambda: kr.rope_paged_qkv_write(h(3, (HQ + 2 * HKV) * D), *paged(), [0, 1, 2], [0, 1, 64], n_heads=HQ),
         r"slots must be in 0..63"),
        (lambda: kr.rope_paged_qkv_write(h(3, (HQ + 2 * HKV) * D), *paged(), [0, 1], [0, 1, 2], n_heads=HQ),
         "3 tokens but 2 positions"),
        (lambda: kr.rope_paged_qkv_write(h(3, (HQ + 2 * HKV) * D), *paged(), [0, 1, 2], [0, 1, 2], n_heads=HQ,
                                         neox=True, q_norm=mx.ones((D,))), "both q_norm and k_norm"),
        (lambda: kr.rope_paged_qkv_write(h(3, (HQ + 2 * HKV) * 32), *paged(d=32), [0, 1, 2], [0, 1, 2], n_heads=HQ,
                                         neox=True, q_norm=mx.ones((32,)), k_norm=mx.ones((32,))), "multiple of 64"),
    ],
)
def test_rope_paged_qkv_write_refuses_before_launch(call, message):
    with pytest.raises(ValueError, match=message):
        call()
