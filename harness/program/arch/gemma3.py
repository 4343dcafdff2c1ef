"""Gemma 3 (text): llama.cpp's src/models/gemma3.cpp. The embedding times sqrt(d_model); Q and K
head norms before NeoX RoPE; RMSNorm of attention's and the FFN's outputs before each residual
add (post_attention_norm, post_ffw_norm); a GELU-gated FFN (tanh approximation); a tied head.
Sliding-window attention (`gemma3.attention.sliding_window`, 512) in every layer but each sixth
(`attention.sliding_window_pattern` where the file gives it), the sliding layers with RoPE base
10000 (`rope.freq_base_swa`) and no scaling, the global ones with the file's base and scaling.
Attention scale 1/sqrt(head_dim) (llama.cpp: 1/sqrt(d_model / heads) for the 27B, which has 62
layers). The GGUF converter has already added Gemma's 1 to every norm weight."""

from harness.program.arch import Architecture


def _hparams(fields: dict) -> dict:
    """llama.cpp's gemma3 loader: the 27B (62 layers) scales attention by its width a head."""
    if fields["n_layers"] == 62:
        fields["attn_scale"] = (fields["d_model"] / fields["n_heads"]) ** -0.5
    return fields


ARCHITECTURE = Architecture(
    name="gemma3", neox=True, head_norm=True, post_norms=True, activation="gelu", embed_scale=True,
    rope_scalings=("none", "linear"), swa_pattern=6, swa_theta=10000.0,
    final_softcap=True, hparams=_hparams,
    presets={
        "tiny-gemma3": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=1, head_dim=64, ff=512, vocab=512,
                            ctx=1024, rope_theta=1000000.0, eps=1e-6, tied=True, sliding_window=8, swa_pattern=2),
        # Gemma-3-270M (the registry's real file: 18 layers, 640 wide, 2048 FFN, 4/1 heads of 256)
        "gemma3-270m-shapes": dict(n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, head_dim=256, ff=2048,
                                   vocab=262144, ctx=32768, rope_theta=1000000.0, eps=1e-6, tied=True,
                                   sliding_window=512),
        # Gemma-3-1B (HF config.json: 26 layers, 1152 wide, 6912 FFN, 4/1 heads of 256, window 512)
        "gemma3-1b": dict(n_layers=26, d_model=1152, n_heads=4, n_kv_heads=1, head_dim=256, ff=6912,
                          vocab=262144, ctx=32768, rope_theta=1000000.0, eps=1e-6, tied=True, sliding_window=512),
    },
)
