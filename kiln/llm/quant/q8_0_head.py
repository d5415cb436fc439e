"""The LM head kept in GGUF's Q8_0 blocks: int8 codes, one fp16 scale per 32.

Most GGUF files store the token embedding (the tied LM head) or the output
tensor as Q8_0. Loaded as float, the head is the largest tensor a decode
step reads (SmolLM2: 113 MB of its 180 MB). Kept as stored, it is 30 MB;
`linear_q8_0` multiplies each code by its block's scale in registers (exact
in fp32: an int8 times an fp16), which is the float weight gguf dequantizes,
and accumulates as linear_f32 does: the logits are bit-identical to the
float head's. Converting every code for every pass of rows makes it
compute-bound from a few rows, so the head takes the kernel up to
Q8_0_HEAD_MAX_ROWS fp32 rows (decode of a few requests, where the bytes it
saves decide) and the float path above (linear_f32, then the packed oneDNN
copy): no step of any size computes other logits than before. The avx512 and
avx512_vnni builds widen the blocks once per call above 8 rows (lane_panels.h: within
0.93-0.96x of oneDNN's GEMM from 64 rows, 1.05-1.5x faster up to 32, Ice
Lake), so there an fp32 head takes the blocks at every row count
(`takes_every_row`): no oneDNN copy of the head is made (SmolLM2: 113 MB),
and a row's logits have the same bits whatever the step's row count (the
oneDNN GEMM summed in another order above PACKED_MIN_ROWS). A bf16
model's head (the table rounded to bf16) reads the blocks the same way up to
the same row count on CPUs with bf16 dot products (`linear_q8_0_bf16`: each
block widened to q * d, rounded to bf16, then linear_bf16's chain; bit-identical
to the bf16 head).

With `--int4-activations int8` (quant/int8_activations.py) the head multiplies
int8 activations instead, `linear_q8_0a8` at every row count (llama.cpp's
Q8_0 x Q8_0 numerics; no longer the float head's bits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kiln.llm.kernels.ops import (
    bf16_dot_products,
    kernels_loaded,
    linear_q8_0,
    linear_q8_0_bf16,
    linear_q8_0a8,
    q8_0_lane_panels,
)
from kiln.llm.kernels.tuning import Q8_0_HEAD_MAX_ROWS
from kiln.llm.layers.linear import project, takes_packed

BLOCK = 32
BLOCK_BYTES = 2 + BLOCK  # fp16 d, then 32 int8 codes


@dataclass(frozen=True)
class Q8_0Weight:
    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / 32], exact fp16 values

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: code * scale, as gguf dequantizes Q8_0."""
        n, k = self.shape
        return (self.codes.float().view(n, k // BLOCK, BLOCK) * self.scales.unsqueeze(-1)).view(n, k)

    def head(self, weight: torch.Tensor, packed: torch.Tensor | None = None) -> Q8_0Head | None:
        """The logits head over these blocks for a model whose float head is `weight`
        (its oneDNN copy `packed`, which a head that `takes_every_row` never reads),
        or None where the kernel never applies (not an fp32 CPU model or a bf16 one on
        a CPU with bf16 dot products, library absent, another shape)."""
        dtype_ok = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_dot_products())
        usable = dtype_ok and weight.device.type == "cpu" and kernels_loaded()
        if not usable or tuple(weight.shape) != self.shape:
            return None
        return Q8_0Head(self, weight, packed)


def q8_0_weight(raw: np.ndarray, rows: int, cols: int) -> Q8_0Weight:
    """The raw bytes of a Q8_0 tensor [rows, cols] (rows of whole 34-byte blocks)."""
    if cols % BLOCK or raw.size != rows * cols // BLOCK * BLOCK_BYTES:
        raise ValueError(f"not a Q8_0 tensor of shape [{rows}, {cols}]")
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, BLOCK_BYTES)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return Q8_0Weight(torch.from_numpy(codes), torch.from_numpy(scales))


class Q8_0Head(nn.Module):
    """Computes the logits of `project(x, weight, packed)` (the float head), bit for bit,
    reading the Q8_0 blocks for up to Q8_0_HEAD_MAX_ROWS rows."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / 32]

    def __init__(self, blocks: Q8_0Weight, weight: torch.Tensor, packed: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("codes", blocks.codes.contiguous())
        self.register_buffer("scales", blocks.scales.contiguous())
        # Plain attributes: the model owns them (the embedding table, its oneDNN copy).
        self.float_weight, self.packed = weight, packed
        # fp32 inputs quantized to int8 at every row count (`--int4-activations int8`).
        self.int8_activations = False

    @property
    def takes_every_row(self) -> bool:
        """Whether fp32 rows take the blocks at any row count (no float fallback needed)."""
        return self.float_weight.dtype == torch.float32 and q8_0_lane_panels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            y = linear_q8_0a8(x, self.codes, self.scales)
            if y is not None:
                return y
        few_rows = x.dim() == 2 and (
            (x.dtype == torch.float32 and self.takes_every_row)
            or (x.shape[0] <= Q8_0_HEAD_MAX_ROWS and not takes_packed(x, self.packed))
        )
        kernel = linear_q8_0_bf16 if x.dtype == torch.bfloat16 else linear_q8_0
        y = kernel(x, self.codes, self.scales) if few_rows else None
        return project(x, self.float_weight, self.packed) if y is None else y

    def extra_repr(self) -> str:
        a8 = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.codes.shape[1]}, out_features={self.codes.shape[0]}, Q8_0 blocks of {BLOCK}{a8}"
