"""What callers of the engine get back, per request."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True):
    """A generated token's log-probability and the top alternatives at its
    position (a msgspec struct: it also crosses the engine-core wire)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int | None = None  # 1 + how many tokens were more likely (set for prompt logprobs)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # why the request failed (finish_reason "error"); the batch's others ran


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # Streaming: what this update added (text and token ids since the last one).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    # Prompt logprobs (entry 0 is None: the first token has no context), when asked.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector
