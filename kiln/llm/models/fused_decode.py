"""Decode-only steps through `kiln::decode_layer`: one call per layer.

At batch 1 the Python around a layer's kernels (module calls, views, kernel
checks: ~15 ops per layer) is a visible share of a step (see
docs/benchmarks.md (One call per decoder layer (`kiln::decode_layer`))).
`kiln::decode_layer` runs the same kernels in the same
order as LlamaLayer.forward, so its output is bit-identical
(tests/unit/llm/kernels/test_decode_layer.py). LlamaModel decides whether
its layers qualify (`LlamaModel.gather_fused_layers`); this module holds
what the kernel takes per layer and when a step may use it.

It applies to a plain (not sharded) fp32 or bf16 CPU model with Kiln's
kernels loaded, every projection in the model's dtype (fp32 models: also
int8 or Kiln-format int4), a head layout the paged kernel takes, and a step
of decode rows only, at most packed_min_rows(dtype) of them (above that the
module path's projections switch to oneDNN).
Families whose layer is Llama's with q/k/v biases (Qwen2), q/k norms
(Qwen3), partial rotary (Phi-4-mini) or a sliding window (Mistral, Phi-3)
pass those to the kernel too (fp32 models; a bf16 model with biases, q/k
norms or partial rotary takes the module path: the kernel's bf16 rounding of
those is not checked against the module path's). A mixture-of-experts layer
(Mixtral, Qwen3-MoE: a SparseMoeBlock MLP) runs its attention half through
`kiln::decode_attention` (the same kernel up to the post-attention norm,
returning (h, x)) and its MoE block in Python: x + moe(h), as
LlamaLayer.forward. Gemma's layers do not qualify (not LlamaLayer).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.attention.options import AttentionOptions
from kiln.llm.kernels.ops import kernels_loaded, packed_min_rows
from kiln.llm.layers.linear import Linear
from kiln.llm.models.arch import ModelArch
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from kiln.llm.quant.int8 import Int8Linear


@dataclass(frozen=True)
class FusedLayer:
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]  # empty when `moe` is set
    down: list[torch.Tensor]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    group_size: int  # of the int4 projections (0: none)
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0  # sliding window (0: none)
    moe: nn.Module | None = None  # the layer's MoE block, run in Python on decode_attention's h


def supported(arch: ModelArch, embed_tokens: torch.Tensor) -> bool:
    """Kernels loaded, a head layout the paged kernel takes, fp32 or bf16 weights on CPU
    (bf16: rope over whole heads only)."""
    heads_ok = (
        arch.head_dim % 16 == 0 and arch.num_heads % arch.num_kv_heads == 0
        and arch.num_heads // arch.num_kv_heads <= 8
    )
    partial_rope = arch.rotary_dim is not None and arch.rotary_dim < arch.head_dim
    dtype_ok = embed_tokens.dtype == torch.float32 or (embed_tokens.dtype == torch.bfloat16 and not partial_rope)
    return kernels_loaded() and heads_ok and dtype_ok and embed_tokens.device.type == "cpu"


def projection_tensors(module: nn.Module, dtype: torch.dtype) -> tuple[list[torch.Tensor], int] | None:
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


def fused_layer(
    qkv: nn.Module, o: nn.Module, mlp: tuple[nn.Module, nn.Module] | nn.Module, input_norm: torch.Tensor,
    post_norm: torch.Tensor,
) -> FusedLayer | None:
    """One layer's kernel arguments, or None if a projection is of a kind the kernel
    does not take (the model's dtype is the norms'). `mlp`: the dense MLP's
    (gate_up, down) projections, or a MoE block (any module: it runs as is)."""
    modules, moe = ((qkv, o, *mlp), None) if isinstance(mlp, tuple) else ((qkv, o), mlp)
    tensors: list[list[torch.Tensor]] = []
    groups: set[int] = set()
    for module in modules:
        found = projection_tensors(module, input_norm.dtype)
        if found is None:
            return None
        tensors.append(found[0])
        groups.add(found[1])
    groups.discard(0)
    if len(groups) > 1:
        return None
    qkv_t, o_t, gate_up_t, down_t = tensors if moe is None else [*tensors, [], []]
    return FusedLayer(qkv_t, o_t, gate_up_t, down_t, input_norm, post_norm, groups.pop() if groups else 0, moe=moe)


def with_extras(
    layer: FusedLayer, qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    options: AttentionOptions,
) -> FusedLayer | None:
    """`layer` with the family's extras, or None if its attention is not what the kernel computes
    (a softmax scale other than head_dim ** -0.5, soft-capped scores) or a bf16 layer has
    extras other than a sliding window."""
    if options.scale is not None or options.logit_softcap is not None:
        return None
    if layer.input_norm.dtype != torch.float32 and (qkv_bias is not None or q_norm is not None or k_norm is not None):
        return None
    return dataclasses.replace(layer, qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm, window=options.sliding_window)


def applies(meta: AttentionMetadata, num_tokens: int, dtype: torch.dtype = torch.float32) -> bool:
    return not meta.prefills and meta.num_decodes == num_tokens <= packed_min_rows(dtype)


def run(
    layers: list[FusedLayer], arch: ModelArch, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[torch.Tensor], meta: AttentionMetadata,
) -> torch.Tensor:
    """The decoder layers over a decode-only step; returns the residual stream."""
    a = arch
    tables = [g.block_tables for g in meta.decode_groups]
    lens = [g.context_lens for g in meta.decode_groups]
    cos, sin = rope
    rotary_dim = a.rotary_dim or 0
    for f, kv_cache in zip(layers, kv_caches, strict=False):
        rest = (
            f.group_size, f.input_norm, f.post_norm, a.rms_norm_eps, cos, sin, kv_cache, meta.slot_mapping,
            tables, lens, meta.block_size, a.num_heads, a.num_kv_heads, a.head_dim, f.qkv_bias, f.q_norm,
            f.k_norm, rotary_dim, f.window,
        )
        if f.moe is None:
            x = torch.ops.kiln.decode_layer(x, f.qkv, f.o, f.gate_up, f.down, *rest)
        else:
            h, x = torch.ops.kiln.decode_attention(x, f.qkv, f.o, *rest)
            x = x + f.moe(h)
    return x
