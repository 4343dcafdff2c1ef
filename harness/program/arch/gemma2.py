"""Gemma 2: llama.cpp's src/models/gemma2-iswa.cpp. Gemma 3's layer without the Q/K head norms,
with softcaps instead: attention scores c * tanh(s / c) before the mask and softmax
(`gemma2.attn_logit_softcapping`, 50 where the file does not say: llama.cpp's default) and the
logits the same (`final_logit_softcapping`, 30). The embedding times sqrt(d_model); post-attention
and post-FFN norms; a GELU-gated FFN; NeoX RoPE at one base in every layer. Sliding-window
attention (`attention.sliding_window`, 4096 where absent) in every other layer, from layer 0.
Attention scale 1/sqrt(head_dim), and for the 27B (46 layers) 1/sqrt(d_model / heads), as
llama.cpp's loader sets f_attention_scale. The GGUF converter has added Gemma's 1 to every norm."""

from harness.program.arch import Architecture


def _hparams(fields: dict) -> dict:
    """What llama.cpp's gemma2 loader fixes where the file is silent, and the 27B's scale."""
    fields.setdefault("sliding_window", 4096)
    fields.setdefault("attn_softcap", 50.0)
    fields.setdefault("final_softcap", 30.0)
    if fields["n_layers"] == 46:
        fields["attn_scale"] = (fields["d_model"] / fields["n_heads"]) ** -0.5
    return fields


ARCHITECTURE = Architecture(
    name="gemma2", neox=True, post_norms=True, activation="gelu", embed_scale=True, swa_pattern=2,
    final_softcap=True, attn_softcap=True, hparams=_hparams,
    presets={
        "tiny-gemma2": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ff=512, vocab=512,
                            ctx=1024, rope_theta=10000.0, eps=1e-6, tied=True, sliding_window=8,
                            attn_softcap=50.0, final_softcap=30.0),
        # Gemma-2-2B (HF config.json: 26 layers, 2304 wide, 9216 FFN, 8/4 heads of 256, window 4096)
        "gemma2-2b": dict(n_layers=26, d_model=2304, n_heads=8, n_kv_heads=4, head_dim=256, ff=9216, vocab=256000,
                          ctx=8192, rope_theta=10000.0, eps=1e-6, tied=True, sliding_window=4096,
                          attn_softcap=50.0, final_softcap=30.0),
    },
)
