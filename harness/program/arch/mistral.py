"""Mistral 7B: llama.cpp's converter writes it as general.architecture `llama` (the same graph: SiLU
FFN, neighbouring RoPE pairs, untied head), so this module adds presets to llama's description
and no graph of its own. Mistral-7B-v0.1's 4096-token sliding window is in neither the GGUF file
nor llama.cpp's llama graph; v0.3 has none."""

from dataclasses import replace

from harness.program.arch import llama

ARCHITECTURE = replace(llama.ARCHITECTURE, presets={
    # Mistral-7B-v0.3 (HF config.json: 32 layers, 4096 wide, 14336 FFN, 32/8 heads, vocab 32768)
    "mistral-7b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ff=14336, vocab=32768,
                       ctx=32768, rope_theta=1000000.0, eps=1e-5, tied=False),
})
