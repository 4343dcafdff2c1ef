"""Model architectures, one small module each (llama.py, qwen3.py): what sets a family apart from
the llama layer that every plan builder spells out (harness.decode.reference_plan,
harness.kernel_decode.kernel_plan read it from a model's Config): how RoPE pairs a head's
elements, whether Q and K heads are normalized before RoPE, and the family's presets (random-weight
files of the real shapes, harness.models). A new family is one more module here, named in
MODULES."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

MODULES = ("llama", "qwen3")


@dataclass(frozen=True)
class Architecture:
    name: str  # GGUF's general.architecture, the prefix of its metadata keys
    neox: bool  # RoPE pairs (i, i + D/2) (NeoX) rather than neighbours (2i, 2i + 1)
    head_norm: bool  # an RMSNorm of every Q and K head (attn_q_norm, attn_k_norm) before RoPE
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)  # Config fields, arch aside


def architectures() -> dict[str, Architecture]:
    found = {}
    for module in MODULES:
        arch = importlib.import_module(f"{__name__}.{module}").ARCHITECTURE
        found[arch.name] = arch
    return found
