"""The small ops of the decode loop in float64: RMSNorm (with the residual add before it), SwiGLU
of a fused gate+up output, argmax (the first of equal maxima), embedding rows."""

from __future__ import annotations

import numpy as np


def rmsnorm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


def swiglu(gate_up: np.ndarray, activation: str = "silu") -> np.ndarray:
    """act(gate) * up of [gate | up]: SiLU, or GELU's tanh approximation (reference.rope.gelu)."""
    from reference.rope import gelu, silu

    g, u = np.split(np.asarray(gate_up, dtype=np.float64), 2, axis=-1)
    return (gelu(g) if activation == "gelu" else silu(g)) * u


def argmax(logits: np.ndarray) -> np.ndarray:
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
