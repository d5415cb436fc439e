"""AWQ 4-bit checkpoints (AutoAWQ GEMM layout) -> Kiln's int4 layout.

Per linear layer `P`, with K input and N output features, G = group_size:

    P.qweight  int32 [K, N/8]    eight codes per word along the output, interleaved:
                                 bits 4i .. 4i+3 of word (k, c) hold output 8c + ORDER[i]
    P.qzeros   int32 [K/G, N/8]  zero points, packed the same way
    P.scales   fp16  [K/G, N]

    w[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n]

with ORDER = (0, 2, 4, 6, 1, 3, 5, 7) (AutoAWQ's pack order). Kiln's form:
scale = scales, min = -z * scale, exact in fp32 (see gptq.py). Only the GEMM
layout (`version` "gemm") with zero points is read; GEMV and the other
kernel-specific layouts are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ModelLoadError
from kiln.llm.quant.formats.int4_weight import Int4Weight, int4_weight, packed_tensors

SUFFIXES = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class AWQSpec:
    group_size: int

    @classmethod
    def from_config(cls, qc: dict[str, Any], source: str) -> AWQSpec:
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ModelLoadError(f"{source}: AWQ with bits {bits!r} is not supported (Kiln loads bits: 4)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"{source}: AWQ version {version!r} is not supported (Kiln loads the GEMM layout)")
        if not qc.get("zero_point", True):
            raise ModelLoadError(f"{source}: AWQ without zero points is not supported")
        group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if group_size != -1 and group_size <= 0:
            raise ModelLoadError(f"{source}: invalid AWQ group_size {group_size}")
        return cls(group_size)


def awq_weight(tensors: dict[str, torch.Tensor], spec: AWQSpec, name: str) -> Int4Weight | torch.Tensor:
    """One layer's stored tensors (keys: SUFFIXES) -> its weight in Kiln's int4 layout."""
    qweight, qzeros, scales = packed_tensors(tensors, name, "AWQ")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = k if spec.group_size == -1 else spec.group_size
    if k % group or tuple(scales.shape) != (k // group, n) or tuple(qzeros.shape) != (k // group, n // 8):
        raise ModelLoadError(
            f"{name}: AWQ tensors do not fit group_size {spec.group_size}: qweight {tuple(qweight.shape)}, "
            f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    q = unpack_columns(qweight).t().contiguous()  # [N, K]
    zeros = unpack_columns(qzeros).to(torch.int32)  # [K/G, N]
    scale = scales.float()
    minimum = -zeros.float() * scale
    return int4_weight(q, scale.t().contiguous(), minimum.t().contiguous(), group, "AWQ")


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's interleaved order -> uint8 [R, 8C] in output order."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8)
    nibbles = (words[:, :, None] >> shifts) & 0xF  # [R, C, i]: output 8c + ORDER[i]
    out = torch.empty_like(nibbles)
    out[:, :, list(ORDER)] = nibbles
    return out.reshape(packed.shape[0], -1).to(torch.uint8)
