"""SparseMoeBlock: a token's output is bit-identical alone (the one-token
path, batch-1 decode) and inside any batch (the grouped path), and equals
the routing as Mixtral defines it, computed here one token and one expert at a time."""
from __future__ import annotations

import pytest
import torch

from kiln.llm.models.arch import ModelArch, MoEShape
from kiln.llm.models.moe import SparseMoeBlock

H = 64


def block(top_k: int, renormalize: bool) -> SparseMoeBlock:
    arch = ModelArch(vocab_size=128, hidden_size=H, intermediate_size=128, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                     tie_word_embeddings=False,
                     moe=MoEShape(num_experts=6, top_k=top_k, intermediate_size=32, renormalize=renormalize,
                                  dense_layers=()))
    moe = SparseMoeBlock(arch)
    gen = torch.Generator().manual_seed(top_k)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return moe


def reference(moe: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """softmax over all experts, top k, (renormalised,) weighted sum of those experts' SwiGLU."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.router_weight.t(), dim=-1)
        weights, ids = torch.topk(probs, moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist(), strict=True):
            gate_up = x[t : t + 1] @ moe.experts[e].gate_up_proj.weight.t()
            gate, up = gate_up.chunk(2, dim=-1)
            out[t] += w * (torch.nn.functional.silu(gate) * up @ moe.experts[e].down_proj.weight.t())[0]
    return out


@pytest.mark.parametrize("top_k,renormalize", [(2, True), (3, False), (1, False)])
def test_one_token_alone_equals_it_inside_a_batch_and_the_reference(top_k, renormalize):
    moe = block(top_k, renormalize)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        batched = moe(x)
        for t in range(x.shape[0]):
            assert torch.equal(moe(x[t : t + 1]), batched[t : t + 1]), t
        torch.testing.assert_close(batched, reference(moe, x), rtol=1e-5, atol=1e-5)
