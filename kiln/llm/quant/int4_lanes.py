"""int4 group-wise Linear in lane layout: a bf16 model's int4 projections on
a CPU with bf16 dot products (kiln::linear_w4l_bf16, linear_w4l_bf16.cpp).

The same codes and (scale, min) as Int4CpuLinear (int4_cpu.py), laid out
sixteen weight rows to a vector instead of along K:

    lanes   int32 [N/16, K/8, 16]: block r, chunk c, lane j holds the
            nibbles of row 16r + j, weights 8c .. 8c+7; weight 8c + 2p in
            bits 4p..4p+3, weight 8c + 2p + 1 in bits 16+4p..16+4p+3
    params  float16 (or float32) [N/16, K/G, 2, 16]: (scale, min) of block
            r and group g, one lane per row

so the kernel widens 32 weights with a shift and one bitwise op (no table, as
kiln::linear_w4_bf16 needs) and multiplies by outer products (vdpbf16ps
against a broadcast x pair), whatever the number of rows: it is faster than
Int4CpuLinear's bf16 paths at every M measured (1 to 1024 rows on Zen 4,
docs/benchmarks.md) and a row's result does not depend on M, so a prompt
gives the same bits cold or cached and in any batch. The weights enter
unrounded (q * scale + min in fp32, where Int4CpuLinear rounds them to bf16
first). Same bytes as Int4CpuLinear: codes 0.5 per weight, parameters 4 per group.

`lay_out_lanes(model, dtype)` swaps a finished bf16 model's Int4CpuLinear
modules for this one where the kernel runs; fp32 models keep Int4CpuLinear
(its fp32 and int8-activation kernels read the other layout).

A second copy for steps of many rows (`--int4-prefill-weights`,
`keep_prefill_copies`): the kernel applies each group's scale and min in fp32,
two FMAs per sixteen dot products per output vector, which a product on bf16
weights does not pay. The copy holds the weights rounded to bf16 (what
`--quantization float` serves), in one of two forms:
- where the CPU has AMX, oneDNN-packed: from INT4_LANES_PACKED_MIN_ROWS rows
  the module multiplies through oneDNN, which runs it on AMX tiles; decode
  steps, which the fused decode layer takes, keep the int4 codes;
- elsewhere (AVX512_BF16 without AMX), in lane layout (`ops.bf16_lanes_copy`): from
  16 rows, prompt chunks and decode steps alike, the module and the fused
  decode layer multiply through kiln::linear_bf16_lanes (the rule is in
  kiln::linear_w4l_bf16, so both paths give a row the same bits): on Zen 4
  1.2x faster than the int4 lanes at 39 rows and level with oneDNN's packed
  GEMM at 2,048 (linear_bf16_lanes.cpp).
Steps of fewer rows get the unrounded weights, so with a copy a row's bits
depend on whether its step reached the threshold, as for float weights
(Linear's packed copy).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.kernels.ops import (
    bf16_dot_products,
    bf16_lanes_copy,
    copies_in_lanes,
    linear_packed,
    linear_w4l_bf16,
    pack_linear_weight,
)
from kiln.llm.kernels.tuning import INT4_LANES_PACKED_MIN_ROWS
from kiln.llm.quant.base import QuantizedLinear
from kiln.llm.quant.int4_cpu import Int4CpuLinear, dequantize, unpack_codes

log = logging.getLogger(__name__)

LANES = 16  # weight rows per vector
CHUNK = 8  # weights of a row per 32-bit lane
SHIFTS = 4 * torch.arange(CHUNK // 2)


def to_lanes(q: torch.Tensor, scale_min: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int [N, K] in 0..15, scale_min [N, K/G, 2]) -> (lanes, params) as the module doc lays them out."""
    n, k = q.shape
    pairs = q.to(torch.int32).reshape(n // LANES, LANES, k // CHUNK, CHUNK // 2, 2)  # [r, j, c, p, first/second]
    words = ((pairs[..., 0] << SHIFTS) | (pairs[..., 1] << (16 + SHIFTS))).sum(-1, dtype=torch.int32)  # [r, j, c]
    params = scale_min.reshape(n // LANES, LANES, k // group_size, 2).permute(0, 2, 3, 1)
    return words.permute(0, 2, 1).contiguous(), params.contiguous()


def from_lanes(lanes: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """to_lanes undone: (codes int32 [N, K], scale_min [N, K/G, 2])."""
    blocks, chunks, _ = lanes.shape
    words = lanes.permute(0, 2, 1).unsqueeze(-1)  # [r, j, c, 1]
    first, second = (words >> SHIFTS) & 0x0F, (words >> (16 + SHIFTS)) & 0x0F
    q = torch.stack([first, second], dim=-1).reshape(blocks * LANES, chunks * CHUNK)
    scale_min = params.permute(0, 3, 1, 2).reshape(blocks * LANES, params.shape[1], 2)
    return q, scale_min


def lanes_apply(module: Int4CpuLinear) -> bool:
    """Whether this layout takes `module`: CPU, rows a multiple of 16, bf16 activations."""
    return (
        module.codes.device.type == "cpu"
        and module.out_features % LANES == 0
        and not module.int8_activations
    )


class Int4LaneLinear(QuantizedLinear):
    _kernel_buffers = ("params",)
    lanes: torch.Tensor  # int32 [N/16, K/8, 16]
    params: torch.Tensor  # float16 (or float32) [N/16, K/G, 2, 16]

    def __init__(self, lanes: torch.Tensor, params: torch.Tensor, group_size: int):
        super().__init__()
        self.out_features, self.in_features = lanes.shape[0] * LANES, lanes.shape[1] * CHUNK
        self.group_size = group_size
        self.register_buffer("lanes", lanes.contiguous())
        self.register_buffer("params", params.contiguous())
        # bf16 copy for steps of many rows (`pack`), or None: oneDNN-packed, or in
        # lane layout (4-D, `lane_copy`). A plain attribute, so state_dict and .to()
        # leave it alone (the engine reports it with the other packed copies).
        self.packed: torch.Tensor | None = None

    @classmethod
    def from_int4_cpu(cls, module: Int4CpuLinear) -> Int4LaneLinear:
        lanes, params = to_lanes(unpack_codes(module.codes), module.scale_min, module.group_size)
        return cls(lanes, params, module.group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [N, K]: q * scale + min, as Int4CpuLinear.dequantized_weight."""
        return dequantize(*from_lanes(self.lanes, self.params), self.group_size)

    def pack(self, in_lanes: bool = False) -> int:
        """Keep a copy of the weights rounded to bf16 for steps of many rows:
        in lane layout (`in_lanes`: from 16 rows, kiln::linear_bf16_lanes), else
        oneDNN-packed (from INT4_LANES_PACKED_MIN_ROWS rows); returns its bytes
        (0 where oneDNN cannot pack). Call last: the copy does not follow later
        changes."""
        weight = self.dequantized_weight().to(torch.bfloat16)
        self.packed = bf16_lanes_copy(weight) if in_lanes else pack_linear_weight(weight)
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    @property
    def lane_copy(self) -> torch.Tensor | None:
        """The bf16 copy in lane layout, or None (no copy, or a oneDNN-packed one)."""
        return self.packed if self.packed is not None and self.packed.dim() == 4 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if (self.packed is not None and self.lane_copy is None and x2.shape[0] >= INT4_LANES_PACKED_MIN_ROWS
                and x2.dtype == torch.bfloat16):
            return linear_packed(x2, self.packed).reshape(*x.shape[:-1], self.out_features)
        y = linear_w4l_bf16(x2, self.lanes, self.params, self.group_size, self.lane_copy)
        if y is None:  # not bf16 CPU activations, or no kernel: the same weights through torch
            y = F.linear(x2, self.dequantized_weight().to(device=x2.device, dtype=x2.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group_size={self.group_size} (Kiln CPU kernel, lane layout)"
        )


def lay_out_lanes(model: nn.Module, dtype: torch.dtype) -> int:
    """In a finished model of `dtype`: every Int4CpuLinear the lane kernel runs
    becomes an Int4LaneLinear, where `dtype` is bf16 and the loaded kernel build
    has bf16 dot products; returns how many."""
    if dtype != torch.bfloat16 or not bf16_dot_products():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Int4CpuLinear and isinstance(child, Int4CpuLinear) and lanes_apply(child):
                setattr(parent, name, Int4LaneLinear.from_int4_cpu(child))
                swapped += 1
    if swapped:
        log.info("%d int4 projections in lane layout (bf16 dot products)", swapped)
    return swapped


PREFILL_COPY_SHARE = 8  # `auto` keeps the copies when they take at most 1/8 of the available memory


def keep_prefill_copies(model: nn.Module, choice: str, available: int | None) -> int:
    """`--int4-prefill-weights` on a finished model: every Int4LaneLinear gets its
    bf16 copy (`pack`, in the form `copies_in_lanes` picks) where `choice` is
    "bf16", or "auto" and the copies fit in 1/PREFILL_COPY_SHARE of `available`
    bytes (unknown: no copy); "int4" keeps none. Returns the bytes kept; logs the
    decision. Gather the model's fused decode layers again after it: a copy in
    lane layout is one of their tensors."""
    lanes = [m for m in model.modules() if isinstance(m, Int4LaneLinear)]
    if not lanes:
        if choice == "bf16":
            log.warning("--int4-prefill-weights bf16: no int4 projections in lane layout here (they need a "
                        "bf16 model on a CPU with AVX512_BF16), nothing to copy")
        return 0
    need = sum(2 * m.in_features * m.out_features for m in lanes)
    if choice == "int4" or (choice == "auto" and (available is None or need * PREFILL_COPY_SHARE > available)):
        if choice == "auto":
            room = "available memory unknown" if available is None else (
                f"more than 1/{PREFILL_COPY_SHARE} of the {available / 2**30:.1f} GiB available")
            log.info("int4 prefill weights: the int4 codes only (a bf16 copy would take %.2f GiB, %s; "
                     "--int4-prefill-weights bf16 keeps one)", need / 2**30, room)
        return 0
    in_lanes = copies_in_lanes()
    kept = sum(m.pack(in_lanes) for m in lanes)
    form = "in lane layout for steps of 16+ rows" if in_lanes else (
        f"oneDNN-packed (AMX) for steps of {INT4_LANES_PACKED_MIN_ROWS}+ rows")
    log.info("int4 prefill weights: a bf16 copy of %d int4 projections, %s (%.2f GiB; "
             "--int4-prefill-weights int4 keeps the codes only)", len(lanes), form, kept / 2**30)
    return kept
