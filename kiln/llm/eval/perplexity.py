"""Perplexity of a Kiln model on a token stream: the quality check for
quantization (and any other change to the numerics).

The stream is cut into non-overlapping windows of `window` tokens; each
window is one prefill through the model with its own small paged KV pool
(the same attention path the engine runs), and every token but the first of
a window is scored by the log-probability the model gave it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.llm.attention.metadata import AttentionMetadata, PrefillSeq
from kiln.llm.models.llama import LlamaModel


@dataclass(frozen=True)
class Perplexity:
    nll: float  # summed negative log-likelihood (nats)
    num_tokens: int  # tokens scored

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.num_tokens)


@torch.inference_mode()
def window_nll(model: LlamaModel, ids: list[int]) -> float:
    """Summed NLL of ids[1:] given their prefixes, one prefill of len(ids) tokens."""
    a, n = model.arch, len(ids)
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    kv = [torch.zeros(2, n, a.num_kv_heads, a.head_dim, dtype=dtype, device=device) for _ in range(a.num_layers)]
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata(slot_mapping=positions, block_size=n, prefills=[PrefillSeq(0, n, n, None)])
    tokens = torch.tensor(ids, device=device)
    hidden = model(tokens, positions, kv, meta)
    logprobs = torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)
    return -logprobs.gather(1, tokens[1:, None]).sum().item()


def perplexity(model: LlamaModel, ids: list[int], window: int = 256, max_windows: int | None = None) -> Perplexity:
    """Perplexity over the first `max_windows` full windows of `ids` (all if None)."""
    if window < 2:
        raise ValueError("window must be at least 2 tokens")
    starts = range(0, len(ids) - window + 1, window)
    if max_windows is not None:
        starts = starts[:max_windows]
    nll = sum(window_nll(model, ids[s : s + window]) for s in starts)
    return Perplexity(nll, len(starts) * (window - 1))
