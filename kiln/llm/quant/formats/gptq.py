"""GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel / optimum) -> Kiln's int4 layout.

Per linear layer `P` (e.g. `model.layers.0.self_attn.q_proj`), with K input
and N output features, G = group_size (-1: K):

    P.qweight  int32 [K/8, N]    eight codes per word along the input:
                                 code of input 8i + j in bits 4j .. 4j+3 of row i
    P.qzeros   int32 [K/G, N/8]  eight zero points per word along the output (same bits)
    P.scales   fp16  [K/G, N]
    P.g_idx    int32 [K]         group of each input feature (optional: k // G)

    w[n, k] = scales[g, n] * (q[k, n] - z[g, n]),  g = g_idx[k]

where z is the stored zero plus 1 in the original format
(`checkpoint_format` "gptq", AutoGPTQ subtracts 1 before packing) and the
stored zero itself in GPTQModel's "gptq_v2". Kiln's form: scale = scales,
min = -z * scale, both exact in fp32 (fp16 scale times a 5-bit integer), so
q * scale + min is the exact product s * (q - z); symmetric checkpoints
(z = 8) keep fp16 parameters, -8 * s being exact there too.

Act-order (`desc_act`) checkpoints assign input features to groups out of
order (g_idx is a permutation of the plain one). Kiln sorts the features by
group (stable), stores the codes in that order, and the layer permutes its
input to match (`Int4Weight.input_perm`); q|k|v and gate|up share one input,
so they fuse when their permutations agree, as GPTQ's (computed from the
same input Hessian) do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ModelLoadError
from kiln.llm.quant.formats.int4_weight import Int4Weight, int4_weight, packed_tensors

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


@dataclass(frozen=True)
class GPTQSpec:
    group_size: int  # -1: one group per row
    zero_offset: int  # added to each stored zero point

    @classmethod
    def from_config(cls, qc: dict[str, Any], source: str) -> GPTQSpec:
        bits = qc.get("bits", 4)
        if bits != 4:  # "4" (a string) said "GPTQ with 4 bits is not supported"
            raise ModelLoadError(f"{source}: GPTQ with bits {bits!r} is not supported (Kiln loads bits: 4)")
        fmt = str(qc.get("checkpoint_format") or "gptq").lower()
        if fmt not in _ZERO_OFFSET:
            raise ModelLoadError(
                f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (Kiln loads 'gptq' and 'gptq_v2')"
            )
        group_size = int(qc.get("group_size", 128))
        if group_size != -1 and group_size <= 0:
            raise ModelLoadError(f"{source}: invalid GPTQ group_size {group_size}")
        return cls(group_size, _ZERO_OFFSET[fmt])


def gptq_weight(tensors: dict[str, torch.Tensor], spec: GPTQSpec, name: str) -> Int4Weight | torch.Tensor:
    """One layer's stored tensors (keys: SUFFIXES, g_idx optional) -> its
    weight in Kiln's int4 layout (float32 where the layout does not fit)."""
    qweight, qzeros, scales = packed_tensors(tensors, name, "GPTQ")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k if spec.group_size == -1 else spec.group_size
    groups = -(-k // group)
    if k % group or tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // 8) or n % 8:
        raise ModelLoadError(
            f"{name}: GPTQ tensors do not fit group_size {spec.group_size}: qweight {tuple(qweight.shape)}, "
            f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    q = unpack_rows(qweight).t()  # [N, K]
    zeros = unpack_rows(qzeros.t()).t().to(torch.int32) + spec.zero_offset  # [K/G, N]
    scale = scales.float()  # [K/G, N]
    g_idx = tensors.get("g_idx")
    perm = act_order_permutation(g_idx, k, group, name)
    if perm is not None:
        q = q[:, perm]
    minimum = -zeros.float() * scale
    return int4_weight(q.contiguous(), scale.t().contiguous(), minimum.t().contiguous(), group, "GPTQ", perm)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] with eight 4-bit codes per word, code j in bits 4j.. ->
    uint8 [8R, C]: word (i, c) gives rows 8i .. 8i+7 of column c."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # as unsigned
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    codes = (words[:, None, :] >> shifts) & 0xF
    return codes.reshape(-1, packed.shape[1]).to(torch.uint8)


def act_order_permutation(g_idx: torch.Tensor | None, k: int, group: int, name: str) -> torch.Tensor | None:
    """None when g_idx is the plain k // group; else the input order that
    makes the groups contiguous (each group must hold `group` features)."""
    plain = torch.arange(k) // group
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    if tuple(g_idx.shape) != (k,):
        raise ModelLoadError(f"{name}: g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
    if torch.equal(g_idx, plain):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], plain):
        raise ModelLoadError(f"{name}: g_idx does not give every group {group} input features")
    return perm
