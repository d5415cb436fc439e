"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): each token goes to
the `top_k` of `num_experts` SwiGLU experts its router scores highest.

Routing as both families define it: softmax over all experts' router logits
(in float32), the top k kept, their probabilities renormalised to sum to one
when the family says so (Mixtral always; Qwen3-MoE with norm_topk_prob).

The experts run grouped, not per token: the step's (token, expert) pairs are
sorted by expert, and each expert with work runs once over all its rows
(gathered with index_select; one gate|up and one down projection, through
Kiln's linear kernels like any Linear) before its weighted output is added
back into the tokens' rows (index_add_, experts in ascending order, so a
token's sum never depends on what else is in the batch). A step of one token
(batch-1 decode) skips the sorting and scattering: its k experts run directly
and their weighted outputs are summed in the same ascending order, so the
result is bit-identical to the grouped path's.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kiln.llm.layers.linear import linear
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.mlp import LlamaMLP


class SparseMoeBlock(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        if arch.moe is None:
            raise ValueError("SparseMoeBlock needs an arch with a MoE shape")
        moe = arch.moe
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        # A plain parameter, not a Linear: weight-only quantization leaves the router float.
        self.router_weight = nn.Parameter(torch.empty(moe.num_experts, arch.hidden_size), requires_grad=False)
        self.experts = nn.ModuleList(LlamaMLP(arch, moe.intermediate_size) for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] long, weights [T, k] in x's dtype) per token."""
        probs = torch.softmax(linear(x, self.router_weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        if x.shape[0] == 1:
            return self._one_token(x, ids[0].tolist(), weights)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # pair p = token p // k, its (p % k)-th choice
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        pair_weights = weights.flatten().index_select(0, order).unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(cast("list[nn.Module]", list(self.experts)), counts, strict=True):
            if n:
                rows = tokens[start : start + n]
                out.index_add_(0, rows, expert(x.index_select(0, rows)) * pair_weights[start : start + n])
                start += n
        return out

    def _one_token(self, x: torch.Tensor, chosen: list[int], weights: torch.Tensor) -> torch.Tensor:
        """x [1, H] through its chosen experts, summed in ascending expert order
        (the grouped path's 0 + a + b, without the zeros: 0 + a == a)."""
        parts = [self.experts[chosen[j]](x) * weights[:, j : j + 1]
                 for j in sorted(range(len(chosen)), key=chosen.__getitem__)]
        return sum(parts[1:], parts[0])
