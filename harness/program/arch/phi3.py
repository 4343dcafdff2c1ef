"""Phi-3 (mini, 4k): llama.cpp's src/models/phi3.cpp. One attn_qkv matrix [q; k; v] and one ffn_up
matrix [gate; up] (no ffn_gate), NeoX RoPE pairs, SiLU-gated FFN, an untied head, no biases. The
file's sliding window (`phi3.attention.sliding_window`, 2047) is read and not applied, as
llama.cpp's phi3 loader turns it off ("Phi SWA is currently disabled", llama.cpp PR 13676): lathe
is judged against llama.cpp on the same file, and the two differ only past 2047 tokens. The 128k
models' LongRoPE factors (rope_factors_long/short) are refused by the loader."""

from harness.program.arch import Architecture

ARCHITECTURE = Architecture(
    name="phi3", neox=True, fused_qkv=True, fused_gate_up=True,
    not_applied=("attention.sliding_window",),
    presets={
        "tiny-phi3": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=4, head_dim=64, ff=512, vocab=512,
                          ctx=1024, rope_theta=10000.0, eps=1e-5, tied=False),
        # Phi-3-mini-4k-instruct (HF config.json: 32 layers, 3072 wide, 8192 FFN, 32 heads of 96, its window 2047 not applied)
        "phi3-mini": dict(n_layers=32, d_model=3072, n_heads=32, n_kv_heads=32, head_dim=96, ff=8192, vocab=32064,
                          ctx=4096, rope_theta=10000.0, eps=1e-5, tied=False),
    },
)
