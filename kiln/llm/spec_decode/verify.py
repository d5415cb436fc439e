"""Runner side of speculation: the target's logits for the 1 + k fed
positions of each speculative chunk -> the tokens to append.

Row i of a chunk (after the request's last token and drafts d_1..d_i) is
processed as if d_1..d_i were already output: penalties, min_tokens and
logit bias see the same history they would see without speculation.
"""
from __future__ import annotations

import torch

from kiln.llm.request import Request
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling.sampler import Sampler, needs_processing, row_argmax
from kiln.llm.scheduler.output import ScheduledChunk
from kiln.llm.spec_decode.proposer import Proposer
from kiln.llm.spec_decode.rejection import greedy_accept, rejection_sample


def as_if_output(request: Request, extra: list[int]) -> Request:
    """A throwaway copy of `request` whose output also holds `extra`."""
    return Request(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        request.eos_token_ids,
        output_token_ids=request.output_token_ids + extra,
    )


def row_requests(chunks: list[ScheduledChunk]) -> list[Request]:
    """One (virtual) request per logit row, in row order."""
    rows: list[Request] = []
    for c in chunks:
        rows.extend(as_if_output(c.request, c.draft_token_ids[:i]) for i in range(1 + len(c.draft_token_ids)))
    return rows


def verify(
    logits: torch.Tensor, chunks: list[ScheduledChunk], sampler: Sampler, proposer: Proposer | None
) -> dict[str, list[SampledToken]]:
    """logits: [sum(1 + len(drafts)), V], the rows of `chunks` in order."""
    rows: list[Request] = []
    if any(needs_processing(p, c.request) or not p.greedy for c in chunks for p in [c.request.sampling_params]):
        rows = row_requests(chunks)
        logits = sampler.process(logits.clone(), rows)
    argmax = row_argmax(logits).tolist()
    random_rows = [i for i, r in enumerate(rows) if not r.sampling_params.greedy]
    if random_rows:  # one batched warp; logit row i is warped row where[i]
        warped = sampler.warp(logits[random_rows], [rows[i] for i in random_rows])
        where = {i: j for j, i in enumerate(random_rows)}
    out: dict[str, list[SampledToken]] = {}
    row = 0
    for c in chunks:
        n = 1 + len(c.draft_token_ids)
        if c.request.sampling_params.greedy:
            tokens = greedy_accept(argmax[row : row + n], c.draft_token_ids)
        else:
            probs = warped[where[row] : where[row] + n]
            q = proposer.draft_probs(c.request.request_id) if proposer else None
            q = None if q is None else q[: n - 1]
            tokens = rejection_sample(probs, c.draft_token_ids, q, sampler.generator_for(c.request))
        out[c.request.request_id] = [SampledToken(t) for t in tokens]
        row += n
    return out
