"""Outputs over a chunk's every position, not just its last: prompt
logprobs, and the pooled hidden state of an embedding request.

Prompt logprobs: the row of position p scores prompt token p + 1 (raw
model logits, log-softmax at temperature 1, as vLLM reports them), with its
rank and the top alternatives. Positions already reported (a preempted
request computes its prompt again) are skipped. Embeddings: the final
(normed) hidden state of the last prompt token, or the mean over all of
them; a prompt split over several chunks is summed chunk by chunk.
"""
from __future__ import annotations

import torch

from kiln.llm.outputs import TokenLogprob
from kiln.llm.request import Request

ROWS_PER_SLICE = 128  # logits of at most this many prompt rows at once ([rows, vocab] floats)


def wants_prompt_outputs(request: Request) -> bool:
    return request.prefill_only or request.sampling_params.prompt_logprobs is not None


def prompt_logprobs(
    compute_logits, hidden: torch.Tensor, request: Request, start: int, num_tokens: int
) -> list[TokenLogprob]:
    """Logprobs of prompt tokens start+1 .. start+num_tokens (those inside the
    prompt and not reported yet); `hidden` holds the chunk's rows."""
    k = request.sampling_params.prompt_logprobs or 0
    first = max(start + 1, request.num_prompt_logprobs_done)
    last = min(start + num_tokens, request.num_prompt_tokens - 1)  # last position scored
    out: list[TokenLogprob] = []
    for lo in range(first, last + 1, ROWS_PER_SLICE):
        hi = min(lo + ROWS_PER_SLICE, last + 1)
        logprobs = compute_logits(hidden[lo - 1 - start : hi - 1 - start]).float().log_softmax(dim=-1)
        targets = torch.tensor(request.prompt_token_ids[lo:hi], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=1) + 1
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:0].expand(hi - lo, 0))
        for t, lp, rank, ids, values in zip(
            targets.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(),
            strict=True,
        ):
            out.append(TokenLogprob(t, lp, list(zip(ids, values, strict=True)), rank))
    if last >= first:
        request.num_prompt_logprobs_done = last + 1
    return out


class Pooler:
    """Pools embedding requests' hidden states across their prompt chunks."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, request: Request, hidden: torch.Tensor, start: int, done: bool) -> list[float] | None:
        """Take a chunk's rows; the pooled vector once the prompt is done."""
        rid = request.request_id
        if request.pooling == "last":
            return hidden[-1].float().tolist() if done else None
        total = hidden.float().sum(dim=0)
        if start > 0 and rid in self.sums:  # start == 0: a first (or recomputed) chunk
            total = total + self.sums[rid]
        if not done:
            self.sums[rid] = total
            return None
        self.sums.pop(rid, None)
        return (total / request.num_prompt_tokens).tolist()

    def forget(self, request_id: str) -> None:
        self.sums.pop(request_id, None)
