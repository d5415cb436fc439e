"""Linear layers: y = x @ W^T with W stored [out_features, in_features].

Every projection in a model is a `Linear`, so the two things that change how
a projection is stored and run plug in here and nowhere else:
- tensor parallelism shards W by rows (column-parallel) or columns
  (row-parallel) before it is loaded;
- weight-only quantization replaces the float W by packed integers and a
  matching kernel after it is loaded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.kernels import ops
from kiln.llm.kernels.ops import copy_for_many_rows, linear_copy, packed_min_rows


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T; up to LINEAR_MAX_ROWS (fp32) or BF16_LINEAR_MAX_ROWS
    (bf16) rows (decode, verification, short prefill chunks) take Kiln's kernel."""
    y = ops.linear(x, weight)
    return F.linear(x, weight) if y is None else y


def takes_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether `project` runs x through the weight's copy for many rows: there is
    one, x is in its dtype and has more than packed_min_rows(dtype) rows."""
    return packed is not None and x.dim() == 2 and x.dtype == packed.dtype and x.shape[0] > packed_min_rows(x.dtype)


def project(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T, through `packed` (weight's copy_for_many_rows: oneDNN-packed,
    or bf16 in lane layout) where `takes_packed`, else `linear`."""
    if packed is not None and takes_packed(x, packed):
        return linear_copy(x, packed)
    return linear(x, weight)


def pack_for_prefill(model: nn.Module) -> int:
    """Pack every `Linear` of a finished model (`Linear.pack`: fp32 or bf16
    CPU weights); returns how many got a packed copy."""
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
            packed += module.packed is not None
    return packed


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        # oneDNN copy of the weight (`pack`); a plain attribute, so
        # state_dict and .to() leave it alone and forward checks the dtype.
        # Both copies are kept on purpose (measured, docs/benchmarks.md): decode
        # rows run Kiln's kernels (and kiln::decode_layer) on the plain [N, K]
        # weight, prefill runs oneDNN on the blocked copy (1.14x MKL's GFLOP/s;
        # 512-token prefill 1.4 -> 1.2 s). Neither kernel reads the other's layout.
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Keep a copy of the weight for inputs of many rows (fp32 or bf16 CPU
        weights; `copy_for_many_rows`: oneDNN-packed, or a bf16 weight in lane
        layout on CPUs with AVX512_BF16 and no AMX). Call last: the copy does not
        follow later changes to the weight."""
        self.packed = copy_for_many_rows(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
