"""The proposer interface, and which requests get drafts after a step."""
from __future__ import annotations

import abc

import torch

from kiln.config import SpecConfig
from kiln.llm.request import Request


class Proposer(abc.ABC):
    @abc.abstractmethod
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """Up to num_drafts[i] draft tokens to follow requests[i]'s tokens."""

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        """[len(drafts), V] distribution each draft was drawn from in the
        last proposal; None means each draft is a point mass."""
        return None

    def retain(self, live_ids: set[str]) -> None:
        """Drop per-request state of every request not in `live_ids`."""
        return None


def plan_drafts(running: list[Request], config: SpecConfig, max_model_len: int) -> tuple[list[Request], list[int]]:
    """Requests that should get drafts for the next step, with how many.

    Off for the whole step if more than `max_batch_for_speculation` requests
    run. A request qualifies while decoding (one token left to compute), if
    it did not opt out, asks no logprobs and is not a seeded draw; its drafts
    leave room for the bonus token under max_tokens and stay inside max_model_len.

    A seeded request that samples is never speculated: rejection sampling draws
    from its generator otherwise than the plain sampler, so its answer would
    depend on whether the batch it ran in was small enough to speculate.
    """
    if len(running) > config.max_batch_for_speculation:
        return [], []
    chosen, counts = [], []
    for r in running:
        p = r.sampling_params
        seeded_draw = p.seed is not None and not p.greedy
        if not p.speculate or seeded_draw or p.logprobs is not None or r.num_computed_tokens != r.num_tokens - 1:
            continue
        k = min(config.num_speculative_tokens, p.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
        if k > 0:
            chosen.append(r)
            counts.append(k)
    return chosen, counts
