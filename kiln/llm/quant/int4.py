"""int4 weight-only Linear: group-wise asymmetric quantization.

Each run of `group_size` weights along the input dimension of one output
row gets its own scale and zero (torchao / gpt-fast convention):

    scale = (max - min) / 15,   q = round((w - min) / scale) in [0, 15]
    w ~= (q - 8) * scale + zero,  zero = min + 8 * scale   (i.e. q*scale + min)

so the error of each weight is at most scale / 2. On CPU with Kiln's kernel
library built, quantize_weight uses int4_cpu.py's format and kernel instead
(fp32 activations; bench/linear_quant.py compares the two); this module is
the path everywhere else. Packing and matmul are torch's tinygemm-style
kernels: `_convert_weight_to_int4pack_for_cpu` +
`_weight_int4pack_mm_for_cpu` on CPU (int32 [N, K] codes in; float32,
bfloat16 or float16 activations; bfloat16 is the fast one, see base.py),
`_convert_weight_to_int4pack` + `_weight_int4pack_mm` on CUDA (uint8
[N, K/2] codes in, two per byte, high nibble first; bfloat16 only). The
packed layout depends on the device, so a module is packed on the device
it runs on.
"""
from __future__ import annotations

import torch

from kiln.llm.quant.base import QuantizedLinear, kernel_dtype

INNER_K_TILES = 8  # CUDA tinygemm tile parameter (2, 4 or 8); the CPU kernel ignores it


def int4_supported(in_features: int, out_features: int, group_size: int, device: torch.device) -> bool:
    """Shapes the packed kernels accept (others stay float)."""
    if in_features % group_size:
        return False
    if device.type == "cuda":
        return out_features % 8 == 0 and in_features % (INNER_K_TILES * 16) == 0
    return out_features % 16 == 0  # _convert_weight_to_int4pack_for_cpu's requirement


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scales [K/G, N], zeros [K/G, N]) in float32."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = ((hi - lo) / 15.0).clamp(min=1e-6)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    zeros = lo + 8.0 * scales
    return q.reshape(n, k), scales.t().contiguous(), zeros.t().contiguous()


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    g = (q.float() - 8.0).reshape(n, k // group_size, group_size)
    return (g * scales.t().float()[..., None] + zeros.t().float()[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 codes [N, K] -> the device kernel's packed layout."""
    q = q.to(device)
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INNER_K_TILES)
    as_bytes = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(as_bytes.contiguous(), INNER_K_TILES)


class Int4Linear(QuantizedLinear):
    _kernel_buffers = ("scales_and_zeros",)
    weight_int4: torch.Tensor  # the device kernel's packed layout
    scales_and_zeros: torch.Tensor  # [K/G, N, 2], the kernel's dtype

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, group_size: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = scales_and_zeros.shape[1]
        self.group_size = group_size
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/G, N, 2], float

    @classmethod
    def from_codes(
        cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
        device: torch.device, model_dtype: torch.dtype,
    ) -> Int4Linear:
        dtype = kernel_dtype(device, model_dtype, bf16_only=True)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(device, dtype).contiguous()
        return cls(pack_int4(q, device), scales_and_zeros, q.shape[1], group_size)

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int) -> Int4Linear:
        q, scales, zeros = quantize_int4(weight, group_size)
        return cls.from_codes(q, scales, zeros, group_size, weight.device, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scales_and_zeros
        x2 = x.reshape(-1, self.in_features).to(sz.dtype)
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight_int4, self.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.weight_int4, self.group_size, sz)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group_size={self.group_size}"
