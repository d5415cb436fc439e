"""Quantized replacements for a loaded model's float projections.

`quantize_linears` swaps every `Linear` of a module tree for a quantized one;
`quantize_weight` makes one quantized module from a weight (the LM head's
copy: see LlamaModel.finish). Both run after the weights are loaded and
moved to their device, before the cast to the compute dtype: codes and
scales come from the float32 weights, and the later cast only touches the
float scale buffers. A tensor-parallel shard is just a smaller `Linear`, so
this composes with sharding done before load.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.llm.layers.linear import Linear
from kiln.llm.quant.int4 import Int4Linear, int4_supported
from kiln.llm.quant.int4_cpu import Int4CpuLinear, int4_cpu_supported
from kiln.llm.quant.int8 import Int8Linear

log = logging.getLogger(__name__)

QUANTIZATION_METHODS = (None, "int8", "int4")
# The LM head is int8 in both modes: it is a large share of the weights a
# decode step reads, and an int4 head costs far more quality than int4 for
# the other projections (see docs/benchmarks.md (Weight-only quantization)).
HEAD_METHOD = "int8"


def quantize_weight(weight: torch.Tensor, method: str, group_size: int) -> nn.Module | None:
    """A quantized module computing x @ weight^T, or None if the shape is unsupported."""
    if method == "int8":
        return Int8Linear.from_float(weight)
    if int4_cpu_supported(weight, group_size):
        return Int4CpuLinear.from_float(weight, group_size)
    out_features, in_features = weight.shape
    if not int4_supported(in_features, out_features, group_size, weight.device):
        return None
    return Int4Linear.from_float(weight, group_size)


def quantize_linears(model: nn.Module, method: str, group_size: int) -> None:
    """Swap every `Linear` in `model` for a `method`-quantized module, in place;
    a Linear whose shape the kernel does not take stays float."""
    if method not in QUANTIZATION_METHODS or method is None:
        raise ValueError(f"unknown quantization method {method!r}")
    kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                quantized = quantize_weight(child.weight.detach(), method, group_size)
                if quantized is None:
                    kept += 1
                else:
                    setattr(parent, name, quantized)
    if kept:
        log.warning("%s: %d Linear layers have shapes the kernel does not take and stay float", method, kept)
