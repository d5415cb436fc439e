from __future__ import annotations

import torch

from kiln.llm.kernels import ops


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.rms_norm(x, self.weight, self.eps)
        return reference_rms_norm(x, self.weight, self.eps) if y is None else y

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused in."""
        fused = ops.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        total = x + residual
        return self(total), total


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like the reference implementation, then cast
    # back before the weight multiply (HF Llama order).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
