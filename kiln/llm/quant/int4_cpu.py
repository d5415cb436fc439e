"""int4 group-wise Linear in the format of Kiln's CPU kernel (`linear_w4`).

The quantization is int4.py's (asymmetric, one scale and one offset per run
of `group_size` weights along the input dimension); the storage differs:

    codes      uint8 [N, K/2]: each run of 64 weights of a row as eight
               little-endian 32-bit words, word j holding weight 8s + j of
               the run in bits 4s .. 4s+3 (s = 0..7), so the kernel takes
               eight weights out of a register with one shift and one mask
    scale_min  float16 [N, K/G, 2]: (scale, min), w = q * scale + min

fp16 parameters cost 0.125 bytes per weight at groups of 32 (fp32: 0.25),
which matters because batch-1 decode is bound by the bytes it reads; they
are what GGUF Q4_1 stores too. The kernel also takes float32 scale_min, for
pre-quantized checkpoints whose parameters fp16 cannot hold exactly
(kiln.llm.quant.formats). `quantize_int4_fp16` picks the codes against
the fp16-rounded grid, so the error per weight stays within half a step
(plus fp16 rounding of the min).

Activations stay float32: the kernel widens the codes in registers and
dequantizes with one FMA. That is compute-bound, so inputs of more than
INT4_DEQUANT_MIN_ROWS rows (prefill chunks) run kiln::linear_w4_panels:
the weight widened (the same FMA) 16 rows at a time into k-major panels
that every x row passes over in an outer-product micro-kernel (1.0-1.6x
oneDNN on the weight widened and packed per call, which ran there before;
linear_w4_panels.cpp). A bf16 model on a CPU with bf16
dot products (AVX512_BF16, AMX) computes what the model in bf16 would (its
weights rounded to bf16, as its activations are) at every row count:
kiln::linear_w4_bf16 up to INT4_BF16_DEQUANT_MIN_ROWS rows (up to 8 the
weights widened in registers, above that a tile at a time; one chain per
output, so a row gets the same bits whatever the batch), and above that
oneDNN's bf16 GEMM on the whole weight widened in memory; 1.06-2.2x the fp32
paths on Zen 4 (kiln/llm/kernels/tuning.py). (`linear_w4a8` quantizes the
activations to int8 instead: faster, SmolLM2's perplexity 0.4-0.7% higher;
not the default, see linear_f32.cpp; the opt-in `--int4-activations int8`
switches an fp32 model's int4 Linears to it: quant/int8_activations.py.)
Where the kernel does not apply (library absent, another device) forward
dequantizes and runs F.linear, so results agree within float rounding.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kiln.llm.kernels.ops import (
    bf16_dot_products,
    dequantize_w4,
    kernels_loaded,
    linear_w4,
    linear_w4_bf16,
    linear_w4_panels,
    linear_w4a8,
)
from kiln.llm.kernels.tuning import INT4_BF16_DEQUANT_MIN_ROWS, INT4_DEQUANT_MIN_ROWS
from kiln.llm.quant.base import QuantizedLinear

RUN = 64  # weights per 32-byte run of codes
FP16_MAX = 65504.0


def int4_cpu_supported(weight: torch.Tensor, group_size: int) -> bool:
    """Whether `weight` [N, K] can take Kiln's CPU int4 kernel."""
    return (
        weight.device.type == "cpu"
        and kernels_loaded()
        and group_size % 32 == 0
        and weight.shape[1] % group_size == 0
        and weight.shape[1] % RUN == 0
        and bool(weight.abs().amax() < FP16_MAX / 2)  # scale and min fit fp16
    )


def quantize_int4_fp16(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scale_min float16 [N, K/G, 2])."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-6).half()
    low = lo.half()
    q = torch.round((w - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), torch.stack([scale, low], dim=-1).contiguous()


def dequantize(q: torch.Tensor, scale_min: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes [N, K] in 0..15 and scale_min [N, K/G, 2] -> float32 [N, K]: q * scale + min."""
    n, k = q.shape
    sm = scale_min.float()
    return torch.addcmul(sm[..., 1:], q.float().reshape(n, k // group_size, group_size), sm[..., :1]).reshape(n, k)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """int codes [N, K] in 0..15 -> uint8 [N, K/2] in the kernel's layout.

    Byte b of little-endian word j of a run holds weights 8(2b) + j (low
    nibble) and 8(2b+1) + j (high nibble), so the packing is one pairing of
    nibbles and a transpose, in bytes."""
    n, k = q.shape
    runs = q.to(torch.uint8).numpy().reshape(n, k // RUN, 4, 2, 8)  # [row, run, byte b, low/high, word j]
    pairs = runs[:, :, :, 0, :] | (runs[:, :, :, 1, :] << 4)  # [row, run, b, j]
    return torch.from_numpy(np.ascontiguousarray(pairs.transpose(0, 1, 3, 2)).reshape(n, k // 2))


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    n, half_k = codes.shape
    words = torch.from_numpy(codes.numpy().view("<u4").astype(np.int64)).reshape(n, half_k // 32, 1, 8)
    return ((words >> (4 * torch.arange(8)).view(1, 1, 8, 1)) & 0x0F).to(torch.int32).reshape(n, half_k * 2)


class Int4CpuLinear(QuantizedLinear):
    _kernel_buffers = ("scale_min",)
    codes: torch.Tensor  # uint8 [N, K/2]
    scale_min: torch.Tensor  # float16 (or float32) [N, K/G, 2]

    def __init__(self, codes: torch.Tensor, scale_min: torch.Tensor, group_size: int):
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        self.group_size = group_size
        # Inputs of fp32 models go through linear_w4a8 (`--int4-activations int8`, quant/int8_activations.py).
        self.int8_activations = False
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale_min", scale_min.contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int) -> Int4CpuLinear:
        q, scale_min = quantize_int4_fp16(weight, group_size)
        return cls(pack_codes(q), scale_min, group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [N, K]: q * scale + min (the kernel fuses it into one FMA;
        equal whenever q * scale is exact in float32, as for fp16 scales and
        every pre-quantized format Kiln reads)."""
        return dequantize(unpack_codes(self.codes), self.scale_min, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype == torch.bfloat16:
            y = self._bf16(x2)
            if y is not None:
                return y.reshape(*x.shape[:-1], self.out_features)
        x2 = x2.float()
        # int8 activations at every row count: a row's result must not depend on the step it ran in.
        a8 = self.int8_activations and x.dtype == torch.float32
        y = linear_w4a8(x2, self.codes, self.scale_min, self.group_size) if a8 else None
        if y is None and x2.shape[0] > INT4_DEQUANT_MIN_ROWS:
            y = linear_w4_panels(x2, self.codes, self.scale_min, self.group_size)
        if y is None:
            y = linear_w4(x2, self.codes, self.scale_min, self.group_size)
        if y is None:
            y = F.linear(x2, self.dequantized_weight().to(x2.device))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _bf16(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T in bf16 on W widened to bf16, where the CPU has bf16 dot products
        (elsewhere the fp32 paths are faster): in registers or tile by tile in Kiln's
        kernel, or for prefill-sized x the whole W for this call through oneDNN."""
        if x.device.type != "cpu" or not bf16_dot_products():
            return None
        if x.shape[0] <= INT4_BF16_DEQUANT_MIN_ROWS:
            return linear_w4_bf16(x, self.codes, self.scale_min, self.group_size)
        weight = dequantize_w4(self.codes, self.scale_min, self.group_size, torch.bfloat16)
        return F.linear(x, weight) if weight is not None else None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group_size={self.group_size} (Kiln CPU kernel)"
        )
