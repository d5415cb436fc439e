"""Swap a loaded model's `Linear` layers (and its LM head) for quantized ones.

Runs after the weights are loaded and moved to their device, before the
model is cast to its compute dtype: codes and scales come from the float32
weights, and the later cast only touches the float scale buffers. A
tensor-parallel shard is just a smaller `Linear`, so this composes with
sharding done before load.

The LM head is quantized too (for a 135M model it is a fifth of the weights
read per decoded token): `model.logits_head` gets a quantized copy, the
float embedding table stays for the token lookup. An untied float head is
released. The head is int8 in both modes by default: on SmolLM2 an int4
head alone raised perplexity by ~5% (its tied embedding ships as Q8_0),
while int4 for every other Linear cost ~0.1% (they ship as Q4_1).
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
INT4_GROUP_SIZES = (32, 64, 128, 256)


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


def quantize_model(
    model: nn.Module, method: str | None, group_size: int = 32, head_method: str | None = "int8"
) -> nn.Module:
    """In place; returns `model`. `method` None leaves it unchanged;
    `head_method` None keeps the float LM head."""
    if method is None:
        return model
    if method not in QUANTIZATION_METHODS:
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
    if head_method is not None and hasattr(model, "lm_head"):
        head = quantize_weight(model.lm_head.detach(), head_method, group_size)
        if head is not None:
            model.logits_head = head
            if model.lm_head is not getattr(model, "embed_tokens", None):
                model.lm_head = nn.Parameter(torch.empty(0, device=model.lm_head.device), requires_grad=False)
    if kept:
        log.warning("%s: %d Linear layers have shapes the kernel does not take and stay float", method, kept)
    return model
