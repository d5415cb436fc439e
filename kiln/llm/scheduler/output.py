"""What the scheduler hands the runner for one step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.llm.request import Request


@dataclass
class ScheduledChunk:
    """Feed `request.all_token_ids[start:start + num_tokens]` at positions
    start.. through the model; sample a token after it iff `sample`."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class RunnerOutput:
    """One sampled token per chunk with `sample` set, keyed by request id."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
