"""A request as the engine core sees it: token ids in, token ids out."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from kiln.llm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed in the engine (its parameters broke a step); the others go on

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


_arrivals = itertools.count()


@dataclass(eq=False)
class Request:
    """Engine-side state of one request.

    Invariant: `num_computed_tokens <= num_tokens`; the tokens in
    `all_token_ids[:num_computed_tokens]` have their keys/values in the KV
    cache. A request is sampled in a step exactly when that step brings
    `num_computed_tokens` up to `num_tokens`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first admission; -1 = not yet
    num_preemptions: int = 0
    stop_token_id: int | None = None  # the token that stopped it, if any
    # Draft tokens proposed for the next step (speculative decoding). They
    # are never part of all_token_ids: only verified tokens are appended.
    spec_token_ids: list[int] = field(default_factory=list)
    # "last" | "mean": an embedding request (prefill only, pooled hidden state out).
    pooling: str | None = None
    # Prompt logprobs computed but not yet reported (when sampling_params.prompt_logprobs is set);
    # positions [1, num_prompt_logprobs_done) were computed once and are never recomputed or resent.
    pending_prompt_logprobs: list = field(default_factory=list)
    num_prompt_logprobs_done: int = 1
    seq: int = field(default_factory=lambda: next(_arrivals))  # tie-break of equal sort keys: arrival order

    @property
    def needs_every_position(self) -> bool:
        """Its prompt's every position feeds an output (embedding, prompt logprobs): no prefix-cache reuse."""
        return self.prefill_only or self.sampling_params.prompt_logprobs is not None

    @property
    def prefill_only(self) -> bool:
        """Runs its prompt and finishes: an embedding, or prompt scoring (max_tokens 0)."""
        return self.pooling is not None or self.sampling_params.max_tokens == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
