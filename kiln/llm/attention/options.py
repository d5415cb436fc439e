"""What one attention layer computes beyond plain causal softmax attention."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionOptions:
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # Keys visible to a query at position p: p - sliding_window + 1 .. p (0: all up to p).
    sliding_window: int = 0
    logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale

    @property
    def is_default(self) -> bool:
        return self == AttentionOptions()
