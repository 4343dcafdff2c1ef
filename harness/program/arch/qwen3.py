"""Qwen3: NeoX RoPE pairs, an RMSNorm of every Q and K head before RoPE, tied embeddings (the
small models), no biases."""

from harness.program.arch import Architecture

ARCHITECTURE = Architecture(
    name="qwen3", neox=True, head_norm=True,
    presets={
        "tiny-qwen3": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ff=512, vocab=512,
                           ctx=1024, rope_theta=1000000.0, eps=1e-6, tied=True),
        "qwen3-0.6b": dict(n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, head_dim=128, ff=3072, vocab=151936,
                           ctx=40960, rope_theta=1000000.0, eps=1e-6, tied=True),
    },
)
