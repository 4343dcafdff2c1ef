"""Peer figures measured outside lathe, which a lathe run is compared against.

LLAMA_CPP_TOK_S: llama.cpp's CUDA decode (flash attention on, batch 1, tg128) on one NVIDIA H200,
random-weight GGUF files of the presets' shapes, as recorded in the project's shared ANCHORS.md
(measured 2026-11-21, llama.cpp as vendored in llama-cpp-python 0.3.36, sm_90). Keyed by
(preset, qtype, depth). These are the only figures in the workbench not measured by it, and only
a labelled fallback: `lathe decode --peer llama.cpp` times llama.cpp on the same file in the same
run (harness.peers), and its rows are what x_llama_cpp divides by. Without them, these are shown
(as x_anchors_md, and as a mark on decode.png named as another run's) beside rows from that GPU.
"""

from __future__ import annotations

LLAMA_CPP_DEVICE = "NVIDIA H200"
LLAMA_CPP_TOK_S: dict[tuple[str, str, int], float] = {
    ("qwen3-0.6b", "q8_0", 0): 761.0,
    ("qwen3-0.6b", "q8_0", 4096): 657.0,
    ("qwen3-0.6b", "q8_0", 16384): 501.0,
    ("llama2-7b", "q4_0", 0): 364.0,
    ("llama3-8b", "q4_0", 0): 348.0,
    ("llama3-8b", "q4_0", 4096): 318.0,
    ("llama3-8b", "q4_0", 16384): 265.0,
    ("llama3-8b", "q8_0", 0): 255.0,
}


def llama_cpp_tok_s(device: str, model: str, qtype: str, depth: int) -> float | None:
    """llama.cpp's tok/s for this configuration on this device, when ANCHORS.md has it."""
    if device != LLAMA_CPP_DEVICE:
        return None
    return LLAMA_CPP_TOK_S.get((model, qtype, int(depth)))
