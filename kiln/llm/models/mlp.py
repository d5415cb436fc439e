"""The gated MLP (SwiGLU / GeGLU) every family's dense layers and every MoE
expert use; its own module so the MoE block and the decoder layers can both
import it."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.kernels import ops
from kiln.llm.layers.linear import Linear
from kiln.llm.models.arch import ModelArch


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """A block's output as is (tensor parallelism replaces it with an all-reduce)."""
    return x


def gated_activation(gate_up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """act(gate) * up for gate_up = gate | up: SwiGLU (silu) or GeGLU (gelu_tanh)."""
    act = ops.silu_mul(gate_up) if hidden_act == "silu" else ops.gelu_tanh_mul(gate_up)
    if act is not None:
        return act
    gate, up = gate_up.chunk(2, dim=-1)
    if hidden_act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


class LlamaMLP(nn.Module):
    hidden_act = "silu"  # a class default, so the sharded subclass has it

    def __init__(self, arch: ModelArch, intermediate_size: int | None = None):
        super().__init__()
        self.inter = intermediate_size or arch.intermediate_size
        self.hidden_act = arch.hidden_act
        self.gate_up_proj: nn.Module = Linear(arch.hidden_size, 2 * self.inter)
        self.down_proj: nn.Module = Linear(self.inter, arch.hidden_size)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = no_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.down_proj(gated_activation(self.gate_up_proj(x), self.hidden_act)))
