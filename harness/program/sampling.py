"""Sampling after the logits, as a composable pipeline applied in a fixed order:
repetition penalty, temperature, top-k, top-p, then greedy (argmax) or a seeded random draw.
Everything stays on the device (MLX ops), so a chained decode can sample without a host round
trip. A stage left at its neutral value is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Sampler:
    repetition_penalty: float = 1.0  # > 1 discourages tokens already seen (CTRL's rule)
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.repetition_penalty <= 0 or self.temperature < 0 or self.top_k < 0:
            raise ValueError("repetition_penalty must be > 0, temperature and top_k >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def filtered(self, logits: mx.array, history: mx.array | None = None) -> mx.array:
        """The logits [vocab] after penalty, temperature, top-k and top-p (-inf where removed)."""
        x = logits.astype(mx.float32)
        if self.repetition_penalty != 1.0 and history is not None and history.size:
            picked = x[history]
            # Positive logits are divided by the penalty, negative ones multiplied (CTRL).
            picked = mx.where(picked > 0, picked / self.repetition_penalty,
                              picked * self.repetition_penalty)
            x = _scatter(x, history, picked)
        if self.temperature > 0:
            x = x / self.temperature
        if self.top_k > 0 and self.top_k < x.size:
            kth = mx.sort(x)[-self.top_k]
            x = mx.where(x < kth, -mx.inf, x)
        if self.top_p < 1.0:
            order = mx.argsort(-x)
            probs = mx.softmax(x[order])
            before = mx.cumsum(probs) - probs  # mass of the tokens ranked above each one
            keep_sorted = before < self.top_p  # the smallest set whose mass reaches top_p
            x = _scatter(x, order, mx.where(keep_sorted, x[order], -mx.inf))
        return x

    def __call__(self, logits: mx.array, history: mx.array | None = None,
                 key: mx.array | None = None) -> mx.array:
        """The next token id (a 0-d uint32 array, on the device)."""
        x = self.filtered(logits, history)
        if self.temperature == 0:
            return mx.argmax(x)
        if key is None:
            key = mx.random.key(0 if self.seed is None else self.seed)
        return mx.random.categorical(x, key=key)


def _scatter(x: mx.array, index: mx.array, values: mx.array) -> mx.array:
    # A copy: assigning into `x` itself would change the caller's array when astype returned it.
    out = mx.array(x)
    out[index] = values
    return out
