"""Logit processors applied before sampling, vectorised over the batch."""
from __future__ import annotations

import torch

from kiln.llm.sampling.transfer import to_device


def token_counts(histories: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[N, V] counts of each token id in each history (one copy to the device
    and one scatter for the whole batch)."""
    device = torch.device(device)
    counts = torch.zeros(len(histories), vocab, device=device)
    flat = [(row, t) for row, ids in enumerate(histories) for t in ids]
    if flat:
        pairs = to_device(flat, torch.long, device)
        counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(flat), device=device), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (CTRL / HF convention) over prompt and output;
    presence and frequency penalties (OpenAI convention) over output only."""
    vocab = logits.shape[1]
    out_counts = token_counts(output_ids, vocab, logits.device)
    seen = (token_counts(prompt_ids, vocab, logits.device) + out_counts) > 0
    rep = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * out_counts
    return logits - presence.unsqueeze(1) * (out_counts > 0).float()


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus / min-p set.
    top_k == 0 disables top-k; top_p == 1 and min_p == 0 disable theirs."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token if the mass strictly before it is below top_p (so the
    # most likely token always survives).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
