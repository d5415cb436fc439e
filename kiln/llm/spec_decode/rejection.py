"""Accepting draft tokens so that the output follows the target exactly.

Greedy (temperature 0): accept drafts while each equals the target's argmax
at its position; then emit the target's argmax at the first mismatch (or
after the last draft). Output is token-for-token the plain greedy output.

Sampling: accept draft d_i with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection draw from normalize(max(0, p_i - q_i)); if all are
accepted draw a bonus token from p_k. Each emitted token is then
distributed exactly as p (Leviathan et al. 2023). A point-mass proposer
(n-gram) has q_i = one-hot(d_i).
"""
from __future__ import annotations

import torch


def greedy_accept(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """target_argmax: len(drafts) + 1 ids. Returns accepted drafts + one."""
    out = []
    for i, d in enumerate(drafts):
        if target_argmax[i] != d:
            break
        out.append(d)
    out.append(target_argmax[len(out)])
    return out


def rejection_sample(
    target_probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """target_probs: [k + 1, V]; draft_probs: [k, V] or None (point masses).
    Returns the accepted drafts followed by one resampled or bonus token."""
    k = len(drafts)
    if k == 0:
        return [_draw(target_probs[0], generator)]
    ids = torch.tensor(drafts, device=target_probs.device)
    rows = torch.arange(k, device=target_probs.device)
    p = target_probs[rows, ids]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[rows, ids]
    u = torch.rand(k, generator=generator, device=target_probs.device)
    # Accept iff u * q <= p (u < p/q without dividing by a zero q).
    accepted = (u * q <= p).tolist()
    out = []
    for i, ok in enumerate(accepted):
        if not ok:
            out.append(_draw(_residual(target_probs[i], draft_probs, i, drafts[i]), generator))
            return out
        out.append(drafts[i])
    out.append(_draw(target_probs[k], generator))
    return out


def _residual(p: torch.Tensor, draft_probs: torch.Tensor | None, i: int, draft: int) -> torch.Tensor:
    if draft_probs is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - draft_probs[i]).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had ~0 chance
        return p
    return residual


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights.float(), 1, generator=generator))
