"""`--int4-activations int8`: the weights kept quantized from a GGUF file
multiply int8 activations, as llama.cpp multiplies them.

Switches an fp32 model's int4 projections (Int4CpuLinear: `linear_w4a8`)
and its Q8_0 LM head (Q8_0Head: `linear_q8_0a8`). Each quantizes an input
row in groups of 32 and takes integer dot products, at every row count, so
a request's answer still does not depend on its batch. Opt-in: faster
batch-1 decode on AVX2, answers may change (docs/benchmarks.md).
"""
from __future__ import annotations

import torch

from kiln.llm.quant.int4_cpu import Int4CpuLinear
from kiln.llm.quant.q8_0_head import Q8_0Head

SWITCHABLE = (Int4CpuLinear, Q8_0Head)


def use_int8_activations(model: torch.nn.Module) -> int:
    """Make every int4 projection and Q8_0 head of `model` quantize fp32 inputs to int8
    before multiplying; returns how many modules it switched."""
    modules = [m for m in model.modules() if isinstance(m, SWITCHABLE)]
    for module in modules:
        module.int8_activations = True
    return len(modules)
