"""What sampling produces per logit row (no tensors, so the scheduler can hold it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # set when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None
