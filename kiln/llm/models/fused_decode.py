"""Decode-only steps through `kiln::decode_layer`: one call per layer.

At batch 1 a step's projections stream the weights at ~10 GB/s, and the
Python around them (module calls, views, kernel checks: ~15 ops per layer)
was another ~15-20% of the step. `kiln::decode_layer` runs the same kernels
in the same order as LlamaLayer.forward, so its output is bit-identical
(tests/unit/kernels/test_decode_layer.py); this module decides when it
applies and hands it each layer's tensors, gathered once after load.

It applies to a plain (not sharded) fp32 or bf16 CPU LlamaModel with Kiln's
kernels loaded, every projection in the model's dtype (fp32 models: also
int8 or Kiln-format int4), a head layout the paged kernel takes, and a step
of decode rows only, at most packed_min_rows(dtype) of them (above that the
module path's projections switch to oneDNN).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.attention.backend import TorchPagedAttention
from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.kernels.ops import kernels_loaded, packed_min_rows
from kiln.llm.layers.linear import Linear
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from kiln.llm.quant.int8 import Int8Linear


@dataclass(frozen=True)
class FusedLayer:
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    group_size: int  # of the int4 projections (0: none)


def projection_tensors(module, dtype: torch.dtype) -> tuple[list[torch.Tensor], int] | None:
    """(tensors the kernel takes, int4 group size or 0) for a model of
    `dtype`, or None. The quantized kernels take fp32 activations only."""
    if type(module) is Linear and module.weight.dtype == dtype and module.weight.is_contiguous():
        return [module.weight], 0
    if dtype != torch.float32:
        return None
    if type(module) is Int8Linear:
        return [module.weight_int8, module.scales_f32], 0
    if type(module) is Int4CpuLinear:
        return [module.codes, module.scale_min], module.group_size
    return None


def prepare(model) -> list[FusedLayer] | None:
    """Each layer's tensors for kiln::decode_layer, or None where it does not apply."""
    from kiln.llm.models.llama import LlamaAttention, LlamaLayer, LlamaMLP

    a = model.arch
    heads_ok = a.head_dim % 16 == 0 and a.num_heads % a.num_kv_heads == 0 and a.num_heads // a.num_kv_heads <= 8
    dtype = model.embed_tokens.dtype
    if not (kernels_loaded() and heads_ok and dtype in (torch.float32, torch.bfloat16)
            and model.embed_tokens.device.type == "cpu"):
        return None
    layers = []
    for layer in model.layers:
        if not (type(layer) is LlamaLayer and type(layer.self_attn) is LlamaAttention and type(layer.mlp) is LlamaMLP
                and type(layer.self_attn.backend) is TorchPagedAttention):
            return None
        parts = [projection_tensors(m, dtype) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(p is None for p in parts):
            return None
        groups = {g for _, g in parts if g}
        if len(groups) > 1:
            return None
        (qkv, _), (o, _), (gate_up, _), (down, _) = parts
        layers.append(FusedLayer(qkv, o, gate_up, down, layer.input_layernorm.weight,
                                 layer.post_attention_layernorm.weight, groups.pop() if groups else 0))
    return layers


def applies(meta: AttentionMetadata, num_tokens: int, dtype: torch.dtype = torch.float32) -> bool:
    return not meta.prefills and meta.num_decodes == num_tokens <= packed_min_rows(dtype)


def run(model, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list[torch.Tensor],
        meta: AttentionMetadata) -> torch.Tensor:
    """The decoder layers over a decode-only step; returns the residual stream."""
    a = model.arch
    tables = [g.block_tables for g in meta.decode_groups]
    lens = [g.context_lens for g in meta.decode_groups]
    cos, sin = rope
    for f, kv_cache in zip(model.fused_layers, kv_caches, strict=False):
        x = torch.ops.kiln.decode_layer(
            x, f.qkv, f.o, f.gate_up, f.down, f.group_size, f.input_norm, f.post_norm,
            a.rms_norm_eps, cos, sin, kv_cache, meta.slot_mapping, tables, lens, meta.block_size,
            a.num_heads, a.num_kv_heads, a.head_dim,
        )
    return x
