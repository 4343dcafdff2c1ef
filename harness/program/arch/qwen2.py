"""Qwen2 / Qwen2.5: NeoX RoPE pairs, biases on Q, K and V (always present), no head norms,
SiLU-gated FFN; the small models tie the head to the embedding."""

from harness.program.arch import Architecture

ARCHITECTURE = Architecture(
    name="qwen2", neox=True, biases=("attn_q", "attn_k", "attn_v"), required_biases=True,
    rope_scalings=("none", "linear", "yarn"),
    presets={
        "tiny-qwen2": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ff=512, vocab=512,
                           ctx=1024, rope_theta=1000000.0, eps=1e-6, tied=True),
        # Qwen2.5-7B (HF config.json: 28 layers, 3584 wide, 18944 FFN, 28/4 heads, vocab 152064)
        "qwen2.5-7b": dict(n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, head_dim=128, ff=18944,
                           vocab=152064, ctx=32768, rope_theta=1000000.0, eps=1e-6, tied=False),
    },
)
