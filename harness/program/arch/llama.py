"""Llama (Llama 2, Llama 3, 3.1-3.3): neighbouring RoPE pairs, as llama.cpp turns them (its
converter permutes Q and K to match), no head norms, SiLU-gated FFN, a separate output matrix
(tied in the small 3.2 models). RoPE scalings as llama.cpp reads them: linear and yarn from
`llama.rope.scaling.*`, and Llama 3.1's factors from the file's rope_freqs.weight. Biases on the
attention matrices are optional (llama.cpp's llama graph adds them where present)."""

from harness.program.arch import BIAS_PARTS, Architecture

ARCHITECTURE = Architecture(
    name="llama", neox=False, biases=BIAS_PARTS, rope_scalings=("none", "linear", "yarn"), rope_freqs=True,
    presets={
        "tiny-llama": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ff=512, vocab=512,
                           ctx=1024, rope_theta=10000.0, eps=1e-5, tied=False),
        "llama2-7b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, head_dim=128, ff=11008, vocab=32000,
                          ctx=4096, rope_theta=10000.0, eps=1e-5, tied=False),
        "llama3-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ff=14336, vocab=128256,
                          ctx=8192, rope_theta=500000.0, eps=1e-5, tied=False),
        # Llama-3.1-8B: Llama 3's shapes and its rope_freqs.weight (llama3 scaling, factor 8 from
        # 8192 tokens; the file's context is 131072, 8192 here as llama3-8b's)
        "llama3.1-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ff=14336,
                            vocab=128256, ctx=8192, rope_theta=500000.0, eps=1e-5, tied=False, rope_freqs=True),
        # Llama-3.2-1B's shapes (its file's context is 131072; 8192 here, as llama3-8b's)
        "llama3.2-1b": dict(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, head_dim=64, ff=8192,
                            vocab=128256, ctx=8192, rope_theta=500000.0, eps=1e-5, tied=True),
    },
)
