"""Model architectures as data, one small module each (llama.py, mistral.py, qwen2.py, qwen3.py,
gemma2.py, gemma3.py, phi3.py): what a family's layer computes, read by every consumer instead of being
spelled out in each of them. The float64 oracle (reference.model.forward), the MLX reference
variant (harness.program.decode.reference_plan) and the loader (harness.program.models.load_gguf) read it; the
kernel variants (harness.program.kernel_decode) map what they can to kernels and name, in one error, what
they cannot (kernel_gaps).

A layer, in the order llama.cpp's graphs (src/models/<arch>.cpp) compute it:

    x = embed(tokens) [* sqrt(d_model)]                                  embed_scale
    per layer i (its window, RoPE base and scale: Config.layer(i)):
      h = rms_norm(x, attn_norm)
      q, k, v = h @ Wq, Wk, Wv [+ biases]      (fused_qkv: one [q; k; v] matrix)
      q, k = rms_norm per head (attn_q_norm, attn_k_norm)                 head_norm
      q, k = rope(q, k)    neighbouring pairs or NeoX (neox); scalings: linear, yarn, llama3 factors
      o = softmax(q k^T * scale [softcapped], causal [, sliding window]) v @ Wo [+ bias]
      o = rms_norm(o, post_attention_norm)                                post_norms
      x = x + o
      h = rms_norm(x, ffn_norm)
      f = (act(h @ Wgate) * (h @ Wup)) @ Wdown   act silu or gelu (fused_gate_up: one [gate; up])
      f = rms_norm(f, post_ffw_norm)                                      post_norms
      x = x + f
    logits = rms_norm(x, output_norm) @ Wout^T [softcapped]   (Wout = the embedding where tied)

A new family is one more module here, named in MODULES.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any

MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
ACTIVATIONS = ("silu", "gelu")  # gelu: the tanh approximation, as ggml_gelu and Gemma's gelu_pytorch_tanh
ROPE_SCALINGS = ("none", "linear", "yarn")  # `<arch>.rope.scaling.type`
BIAS_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output")


@dataclass(frozen=True)
class Architecture:
    name: str  # GGUF's general.architecture, the prefix of its metadata keys
    neox: bool  # RoPE pairs (i, i + D/2) (NeoX) rather than neighbours (2i, 2i + 1)
    head_norm: bool = False  # an RMSNorm of every Q and K head (attn_q_norm, attn_k_norm) before RoPE
    post_norms: bool = False  # RMSNorm of attention's and the FFN's outputs before their residual adds
    activation: str = "silu"  # of the gate: silu, or gelu (tanh approximation)
    embed_scale: bool = False  # the embedding times sqrt(d_model) (Gemma)
    fused_qkv: bool = False  # one attn_qkv matrix [q; k; v] in the file (Phi-3)
    fused_gate_up: bool = False  # ffn_up holds [gate; up] and there is no ffn_gate (Phi-3)
    biases: tuple[str, ...] = ()  # matrices that may carry a .bias tensor (required: required_biases)
    required_biases: bool = False  # Qwen2: attn_q, attn_k and attn_v always have biases
    rope_scalings: tuple[str, ...] = ("none",)  # the scalings llama.cpp reads for this family
    rope_freqs: bool = False  # takes rope_freqs.weight, a divisor a rotation pair (Llama 3.1's llama3 scaling)
    swa_pattern: int = 0  # sliding-window layers: all but every swa_pattern-th (Gemma 3: 6); 0 none
    swa_theta: float = 0.0  # the sliding layers' RoPE base where the file does not say (Gemma 3's
    # 10000); 0: the file's rope.freq_base, and the global RoPE scaling, in every layer
    final_softcap: bool = False  # takes `final_logit_softcapping` (Gemma 2; Gemma 3 where the file gives one)
    attn_softcap: bool = False  # takes `attn_logit_softcapping`: scores c * tanh(s / c) (Gemma 2)
    hparams: Any = None  # f(fields) -> fields: hyperparameters llama.cpp fixes in code, not the file
    not_applied: tuple[str, ...] = ()  # keys llama.cpp's graph reads and then turns off (Phi-3's window)
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)  # Config fields, arch aside

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{self.name}: activation must be one of {ACTIVATIONS}")
        unknown = set(self.rope_scalings) - set(ROPE_SCALINGS)
        if unknown or set(self.biases) - set(BIAS_PARTS):
            raise ValueError(f"{self.name}: unknown rope scalings or bias parts")


@dataclass(frozen=True)
class Layer:
    """What differs between a model's layers: the attention window (None: every position so far),
    the RoPE base, and RoPE's position scale (1 / the linear or yarn factor; sliding layers keep 1)."""

    window: int | None
    theta: float
    freq_scale: float


def architectures() -> dict[str, Architecture]:
    found = {}
    for module in MODULES:
        arch = importlib.import_module(f"{__name__}.{module}").ARCHITECTURE
        if arch.name in found:  # a module of presets over another's graph (mistral: llama's)
            arch = replace(found[arch.name], presets={**found[arch.name].presets, **arch.presets})
        found[arch.name] = arch
    return found
