"""A pre-quantized int4 projection weight, already in Kiln's int4 layout.

The format readers (gptq.py, awq.py, gguf_blocks.py) turn a checkpoint's
stored codes into one of these without a float round trip; the model
installs it as an `Int4CpuLinear` (see stored.py). Every format here means

    w[n, k] = q[n, k] * scale[n, g] + min[n, g],   q in 0..15,  g = k // group_size

with a zero point z written as min = -z * scale. The parameters are kept in
fp16 when every one of them is exact in fp16 (GGUF Q4_0/Q4_1, symmetric
GPTQ), else in fp32 (GPTQ/AWQ zero points, Q4_K sub-scales): the kernel takes
both, so the dequantized weights equal the format's own dequantization.

`input_perm` carries GPTQ's act-order: the stored columns are the
checkpoint's input features in that order, so the layer computes
x[..., input_perm] @ W^T.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.llm.quant.int4_cpu import RUN, Int4CpuLinear, pack_codes


@dataclass(frozen=True)
class Int4Weight:
    codes: torch.Tensor  # uint8 [N, K/2], int4_cpu.pack_codes's layout
    scale_min: torch.Tensor  # float16 or float32 [N, K/G, 2]
    group_size: int
    source: str  # the stored format, for logs ("GPTQ", "GGUF Q4_1", ...)
    input_perm: torch.Tensor | None = None  # int64 [K] (act-order), or None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 2))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the checkpoint's input order."""
        w = self.layer().dequantized_weight()
        if self.input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_perm] = w
        return out

    def layer(self) -> Int4CpuLinear:
        """The kernel module over the stored columns (without the input permutation)."""
        return Int4CpuLinear(self.codes, self.scale_min, self.group_size)

    def module(self) -> nn.Module:
        """What a model installs for this projection."""
        layer = self.layer()
        return layer if self.input_perm is None else PermutedInput(self.input_perm, layer)

    def take_rows(self, index: torch.Tensor) -> Int4Weight:
        """The output rows `index` (a row's codes and parameters move together)."""
        rows = index.numpy()  # numpy: torch's row gather is slower here on small tensors
        return Int4Weight(
            torch.from_numpy(self.codes.numpy()[rows]), torch.from_numpy(self.scale_min.numpy()[rows]),
            self.group_size, self.source, self.input_perm,
        )


class PermutedInput(nn.Module):
    """`inner` applied to x[..., perm]. The fused decode kernel does not take
    it (fused_decode checks module types exactly), so such layers run
    module by module."""

    perm: torch.Tensor

    def __init__(self, perm: torch.Tensor, inner: nn.Module):
        super().__init__()
        self.register_buffer("perm", perm)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


def layout_fits(in_features: int, group_size: int) -> bool:
    """Whether Kiln's int4 layout holds a [*, in_features] weight in groups of `group_size`."""
    return group_size % 32 == 0 and in_features % group_size == 0 and in_features % RUN == 0


def int4_weight(
    q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int, source: str,
    input_perm: torch.Tensor | None = None,
) -> Int4Weight | torch.Tensor:
    """Codes q [N, K] (0..15) with float32 scale and min [N, K/G] -> an
    Int4Weight, or, where the layout does not take the shape, the float32
    weight the codes mean (the same values, dequantized once at load)."""
    n, k = q.shape
    if not layout_fits(k, group_size):
        w = torch.addcmul(minimum[..., None], q.float().reshape(n, k // group_size, group_size), scale[..., None])
        w = w.reshape(n, k)
        if input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, input_perm] = w
        return out
    params = np.stack([scale.float().numpy(), minimum.float().numpy()], axis=-1)
    if exact_in_fp16(params):
        params = params.astype(np.float16)
    return Int4Weight(pack_codes(q), torch.from_numpy(params), group_size, source, input_perm)


def exact_in_fp16(values: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.isfinite(values).all() and (values.astype(np.float16).astype(np.float32) == values).all())


def concat_rows(pieces: Sequence[Int4Weight]) -> Int4Weight | None:
    """The pieces stacked along the output dimension (q|k|v, gate|up), or None
    if they do not share in_features, group size and input permutation."""
    first = pieces[0]
    for p in pieces[1:]:
        if p.shape[1] != first.shape[1] or p.group_size != first.group_size or not _same_perm(p, first):
            return None
    dtypes = {p.scale_min.dtype for p in pieces}
    dtype = torch.float16 if dtypes == {torch.float16} else torch.float32  # fp16 -> fp32 is exact
    return Int4Weight(
        torch.cat([p.codes for p in pieces]),
        torch.cat([p.scale_min.to(dtype) for p in pieces]),
        first.group_size,
        "+".join(dict.fromkeys(p.source for p in pieces)),
        first.input_perm,
    )


def _same_perm(a: Int4Weight, b: Int4Weight) -> bool:
    if a.input_perm is None or b.input_perm is None:
        return a.input_perm is None and b.input_perm is None
    return torch.equal(a.input_perm, b.input_perm)


def packed_tensors(tensors: dict[str, torch.Tensor], name: str, label: str) -> tuple[torch.Tensor, ...]:
    """A GPTQ / AWQ layer's (qweight, qzeros, scales): int32 words of eight codes, float scales. Another
    dtype is a broken file (float "codes" would be truncated into a wrong model in silence)."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    for part, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32:
            raise ModelLoadError(f"{name}: {label} {part} is stored as {tensor.dtype}, not int32 words of 4-bit codes")
    if not scales.is_floating_point():
        raise ModelLoadError(f"{name}: {label} scales are stored as {scales.dtype}, not a float tensor")
    return qweight, qzeros, scales
