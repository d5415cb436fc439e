"""What the scheduler hands the runner for one step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.llm.outputs import TokenLogprob
from kiln.llm.request import Request
from kiln.llm.sampling.output import SampledToken


@dataclass
class ScheduledChunk:
    """Feed `request.all_token_ids[start:start + num_tokens]` at positions
    start.. through the model; sample a token after it iff `sample`.

    A speculative chunk also feeds `draft_token_ids` after the request's last
    token (so `num_tokens == 1 + len(draft_token_ids)`); the runner then
    returns logits-verified tokens for all of its positions.
    """

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens + len(self.draft_token_ids)

    @property
    def feeds_prompt(self) -> bool:
        """Some of its tokens are the prompt's (a prefill chunk, a prompt's tail after a prefix-cache hit)."""
        return self.start < self.request.num_prompt_tokens

    @property
    def num_logit_rows(self) -> int:
        """Rows needing logits: 1 per sampled chunk, 1 + drafts if speculative."""
        return (1 + len(self.draft_token_ids)) if self.sample else 0

    def token_ids(self) -> list[int]:
        if not self.draft_token_ids:
            return self.request.token_slice(self.start, self.start + self.num_tokens)
        return self.request.token_slice(self.start, self.request.num_tokens) + self.draft_token_ids


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
class RunnerOutput:
    """One sampled token per plain chunk with `sample` set, keyed by request
    id; for a speculative chunk, `spec_sampled` holds the accepted drafts
    followed by one target-sampled token (1 to 1 + k tokens)."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    spec_sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # Embedding requests whose prompt finished this step: their pooled hidden state.
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # Logprobs of prompt positions computed this step, for requests that asked.
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
