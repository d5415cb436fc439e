"""int8 weight-only Linear: per-output-channel symmetric scales.

    w[n, k] ~= q[n, k] * scale[n],   q in [-127, 127],   scale = max|w[n, :]| / 127

so the error of each weight is at most scale[n] / 2. With float32
activations on CPU the matmul is Kiln's `linear_w8` kernel: on AVX512_VNNI
CPUs the activations are quantized dynamically to int8 in groups of 32 and
multiplied as bytes (kiln/llm/kernels/linear_int8_vnni.cpp); elsewhere the
int8 weights are widened in registers, fp32 arithmetic, per-row scale on the
finished dot product;
otherwise `torch._weight_int8pack_mm` (CPU, CUDA, MPS, XPU kernels in torch
2.13): y = (x @ q^T) * scale, in the kernel dtype of base.py (bfloat16 on
CPU).
"""
from __future__ import annotations

import torch

from kiln.llm.kernels.ops import linear_w8
from kiln.llm.quant.base import QuantizedLinear, kernel_dtype


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scales float32 [N])."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


class Int8Linear(QuantizedLinear):
    _kernel_buffers = ("scales", "scales_f32")
    weight_int8: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N], the torch kernel's dtype
    scales_f32: torch.Tensor  # [N] float32, for Kiln's kernel

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, scales_f32: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scales", scales)
        # Full-precision scales for the fp32-activation kernel.
        self.register_buffer("scales_f32", (scales if scales_f32 is None else scales_f32).float())

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        q, scales = quantize_int8(weight)
        dtype = kernel_dtype(weight.device, weight.dtype, bf16_only=False)
        return cls(q.to(weight.device), scales.to(weight.device, dtype), scales.to(weight.device))

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.weight_int8, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        # A 16-bit model's rows widen to fp32 for Kiln's kernel (the VNNI builds quantize them
        # to int8 anyway) and its result is rounded once: torch's int8 kernel, the fallback, decoded
        # a bf16 SmolLM2 at 52 tok/s against 116 for this one in fp32 (Zen 4, batch 1).
        y = linear_w8(x2.float() if x2.device.type == "cpu" else x2, self.weight_int8, self.scales_f32)
        if y is None:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(self.scales.dtype), self.weight_int8, self.scales)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"
