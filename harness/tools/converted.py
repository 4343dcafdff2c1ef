"""Files that llama.cpp's own converter made, against llama.cpp: for each family, a
transformers checkpoint of a real model's config (its widths, heads, RoPE, norms and caps; fewer
layers where the real count would only slow the check), randomly initialized, is converted by
llama.cpp's convert_hf_to_gguf.py; `lathe quality` then reads that file and reports the reference
variant's perplexity beside llama-perplexity's on the same file and text, and each kernel
variant's KL divergence from the reference. A loader that read a key wrong, or a layer whose math
differs from llama.cpp's graph, shows as a perplexity apart.

    python -m harness.tools.converted --converter DIR --text PATH [--tokenizer tokenizer.model]
        [--family llama,gemma3,...] [--out DIR] [--variant unfused,fused,megafused]

DIR holds convert_hf_to_gguf.py with its conversion/ and gguf-py/ packages (llama.cpp's sources).
The tokenizer is a SentencePiece model (the families here convert one; the embedding has its
vocabulary): by default one of 1024 BPE pieces trained on the text, with <|endoftext|> among them
(llama.cpp's phi3 vocabulary sets attributes on that token and fails to load without it). The
initializer's spread is raised from transformers' 0.02 so that random logits are far from uniform
and a perplexity tells layers apart. Needs torch, transformers and sentencepiece.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

# The real configs (Hugging Face's config.json fields) each family's file is made from, the
# layer count cut where noted; vocab_size comes from the tokenizer.
REAL_CONFIGS = {
    # Llama-3.2-1B, llama3 RoPE scaling: the converter writes rope_freqs.weight
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                  rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)),
    # Mistral-7B-v0.1
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768,
                    sliding_window=None, tie_word_embeddings=False),
    # Gemma-3-270M, whole (18 layers: five sliding to one global)
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=640,
                   intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]),
    # Gemma-2-2B: softcaps of the scores and the logits
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, query_pre_attn_scalar=256,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    # Qwen2.5-7B: Q/K/V biases
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False,
                  tie_word_embeddings=False),
    # Qwen3-0.6B, whole (28 layers): Q/K head norms
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True),
    # Phi-3-mini-4k: fused QKV and gate+up, heads of 96
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
                 num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
                 rope_theta=10000.0, max_position_embeddings=4096, original_max_position_embeddings=4096,
                 sliding_window=2047, tie_word_embeddings=False),
}
INIT_RANGE = 0.08  # transformers' default 0.02 leaves random logits nearly uniform


def train_tokenizer(text: Path, out: Path, pieces: int = 1024) -> Path:
    """A SentencePiece BPE model of the text (byte fallback: any text encodes), ids 0-3 <pad>,
    <s>, </s>, <unk>, then <|endoftext|>."""
    import sentencepiece

    prefix = out / f"spm-{pieces}"
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(prefix), vocab_size=pieces, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, pad_id=0, bos_id=1, eos_id=2, unk_id=3, user_defined_symbols=["<|endoftext|>"],
        minloglevel=2)
    return prefix.with_suffix(".model")


def make_checkpoint(family: str, tokenizer: Path, out: Path, seed: int = 0) -> Path:
    """A randomly initialized transformers checkpoint of the family's config, with the tokenizer."""
    import sentencepiece
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(REAL_CONFIGS[family])
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer)).vocab_size()
    fields.update(vocab_size=vocab, initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  torch_dtype="float32")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if family.startswith("gemma") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)  # Gemma's norms scale by 1 + w: random w so that they matter
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)  # biases start at zero (Qwen2's Q/K/V): random, so that they count
    where = out / f"hf-{family}"
    shutil.rmtree(where, ignore_errors=True)
    model.save_pretrained(where, safe_serialization=True)
    shutil.copy(tokenizer, where / "tokenizer.model")
    return where


def convert(converter: Path, checkpoint: Path, outfile: Path, outtype: str = "q8_0") -> Path:
    """llama.cpp's convert_hf_to_gguf.py over the checkpoint."""
    cmd = [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile", str(outfile),
           "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint.name}:\n{done.stderr[-3000:]}")
    return outfile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--converter", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, help="a SentencePiece model (default: trained on --text)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--family", default=",".join(REAL_CONFIGS))
    ap.add_argument("--out", type=Path, default=Path("converted"))
    ap.add_argument("--variant", default="unfused,fused,megafused")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--convert-only", action="store_true", help="make the files, measure nothing")
    ap.add_argument("--fresh", action="store_true", help="convert again where the file exists")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or train_tokenizer(Path(args.text), args.out)
    failed = []
    for family in args.family.split(","):
        gguf_file = args.out / f"{family}-converted-q8_0.gguf"
        try:
            if args.fresh or not gguf_file.exists():
                convert(args.converter, make_checkpoint(family, tokenizer, args.out), gguf_file)
        except Exception as err:  # a family that does not convert is reported; the others go on
            print(f"{family}: {type(err).__name__}: {err}", flush=True)
            failed.append(family)
            continue
        print(f"== {family}: {gguf_file.name}, {gguf_file.stat().st_size / 2**20:.1f} MiB", flush=True)
        if args.convert_only:
            continue
        cmd = [sys.executable, "-m", "harness", "quality", str(gguf_file), "--text", args.text, "--ctx", str(args.ctx),
               "--chunks", str(args.chunks), "--variant", args.variant, "--peer", "llama.cpp"]
        if subprocess.run(cmd).returncode:
            failed.append(family)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
