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
int8; fp32 and bf16 models: Kiln-format int4), a head layout the paged kernel takes, and a step
of decode rows only, at most as many as the module path runs the same
projection kernels for (row_limit).
Families whose layer is Llama's with q/k/v biases (Qwen2), q/k norms
(Qwen3), partial rotary (Phi-4-mini) or a sliding window (Mistral, Phi-3)
pass those to the kernel too (fp32 models; a bf16 model with biases, q/k
norms or partial rotary takes the module path: the kernel's bf16 rounding of
those is not checked against the module path's). A mixture-of-experts layer
(Mixtral, Qwen3-MoE: a SparseMoeBlock MLP) runs its attention half through
`kiln::decode_attention` (the same kernel up to the post-attention norm,
returning (h, x)), routes h in Python (SparseMoeBlock.route) and runs its
experts through `kiln::moe_experts` (the block's grouped expert loop in one
call, bit-identical): x + moe(h), as LlamaLayer.forward. (A block whose
experts the kernel does not take runs as a module there.) Gemma's layer
(gemma.py) passes its softmax scale, soft-cap, sandwich norms and GeGLU, and
its sliding-window layers of Gemma 3 their own rope table (`local_rope`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.attention.options import AttentionOptions
from kiln.llm.kernels.ops import kernels_loaded, packed_min_rows
from kiln.llm.kernels.tuning import INT4_DEQUANT_MIN_ROWS
from kiln.llm.layers.linear import Linear
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.mlp import LlamaMLP
from kiln.llm.models.moe import SparseMoeBlock
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from kiln.llm.quant.int4_lanes import Int4LaneLinear
from kiln.llm.quant.int8 import Int8Linear


@dataclass(frozen=True)
class FusedLayer:
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]  # a MoE layer: every expert's, in expert order (empty: the block runs as is)
    down: list[torch.Tensor]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    group_size: int  # of the int4 projections (0: none; negative: int8 activations, --int4-activations int8)
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0  # sliding window (0: none)
    moe: SparseMoeBlock | None = None  # the layer's MoE block: routes decode_attention's h
    scale: float = 0.0  # softmax scale (0: head_dim ** -0.5)
    softcap: float = 0.0  # of the attention scores (0: none)
    attn_out_norm: torch.Tensor | None = None  # Gemma: o normed before its residual add
    mlp_out_norm: torch.Tensor | None = None  # Gemma: the MLP's output normed before its add
    gelu: bool = False  # GeGLU (gelu_tanh) instead of SwiGLU
    local_rope: bool = False  # rotated with the model's local (sliding-window) rope table


@dataclass(frozen=True)
class LayerNorms:
    """A layer's norm weights as the kernel applies them: `input` before attention,
    `pre_mlp` in the add + norm before the MLP; Gemma's sandwich norms also
    `attn_out` (on o, before its add) and `mlp_out` (on the MLP's output)."""

    input: torch.Tensor
    pre_mlp: torch.Tensor
    attn_out: torch.Tensor | None = None
    mlp_out: torch.Tensor | None = None


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
    """(tensors the kernel takes, int4 group size or 0, negated for int8 activations) for a model of
    `dtype`, or None. The quantized kernels take fp32 activations; in a bf16
    model an int8 projection widens its rows to fp32 and rounds its result
    once, as Int8Linear does, and an int4 one runs as Int4CpuLinear runs it at
    decode sizes (bf16 dot products on the weights widened to bf16 where the
    kernel build has them, else the fp32 kernel on rows widened to fp32,
    rounded once); in lane layout (a bf16 model's, Int4LaneLinear) as that module runs it."""
    if type(module) is Linear and module.weight.dtype == dtype and module.weight.is_contiguous():
        return [module.weight], 0
    if type(module) is Int4LaneLinear and dtype == torch.bfloat16:
        copy = module.lane_copy
        return [module.lanes, module.params, *([] if copy is None else [copy])], module.group_size
    if type(module) is Int4CpuLinear and dtype in (torch.float32, torch.bfloat16):
        int8_activations = module.int8_activations and dtype == torch.float32  # the kernel: linear_w4a8
        return [module.codes, module.scale_min], -module.group_size if int8_activations else module.group_size
    if type(module) is Int8Linear and dtype in (torch.float32, torch.bfloat16):
        return [module.weight_int8, module.scales_f32], 0
    return None


def dense_mlp(mlp: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(gate_up, down) of a SwiGLU or GeGLU MLP the kernel computes, else None."""
    if type(mlp) is LlamaMLP and isinstance(mlp, LlamaMLP) and mlp.hidden_act in ("silu", "gelu_tanh"):  # mypy
        return mlp.gate_up_proj, mlp.down_proj
    return None


def _expert_projections(moe: SparseMoeBlock) -> list[nn.Module] | None:
    """gate_up and down of every expert, in expert order, if all are SwiGLU MLPs."""
    experts = [e for e in moe.experts if type(e) is LlamaMLP and isinstance(e, LlamaMLP) and e.hidden_act == "silu"]
    if len(experts) != len(moe.experts):
        return None
    return [p for e in experts for p in (e.gate_up_proj, e.down_proj)]


def fused_layer(
    qkv: nn.Module, o: nn.Module, mlp: tuple[nn.Module, nn.Module] | SparseMoeBlock, norms: LayerNorms,
) -> FusedLayer | None:
    """One layer's kernel arguments, or None if a projection is of a kind the kernel
    does not take (the model's dtype is the norms') or int4 group sizes differ.
    `mlp`: the dense MLP's (gate_up, down) projections, or a MoE block (its
    experts go to the kernel where it takes them all; else the block runs as is)."""
    moe = None if isinstance(mlp, tuple) else mlp
    input_norm = norms.input
    # A MoE block with experts the kernel does not take still runs as a module after the attention half.
    candidates = [list(mlp)] if isinstance(mlp, tuple) else [p for p in (_expert_projections(mlp), []) if p is not None]
    for projections in candidates:
        found = [projection_tensors(m, input_norm.dtype) for m in (qkv, o, *projections)]
        if any(f is None for f in found):
            continue
        tensors = [f[0] for f in found if f is not None]
        groups = {f[1] for f in found if f is not None} - {0}
        if len(groups) > 1:
            continue
        mlp_tensors = tensors[2:]  # gate_up, down alternating (a MoE block: expert by expert)
        gate_up = [t for pair in mlp_tensors[0::2] for t in pair]
        down = [t for pair in mlp_tensors[1::2] for t in pair]
        return FusedLayer(tensors[0], tensors[1], gate_up, down, input_norm, norms.pre_mlp,
                          groups.pop() if groups else 0, moe=moe, attn_out_norm=norms.attn_out,
                          mlp_out_norm=norms.mlp_out)
    return None


def with_extras(
    layer: FusedLayer, qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    options: AttentionOptions, gelu: bool = False, local_rope: bool = False,
) -> FusedLayer | None:
    """`layer` with the family's extras, or None if a bf16 layer has q/k/v biases or
    q/k norms (their bf16 rounding in the kernel is not checked against the module path's)."""
    if layer.input_norm.dtype != torch.float32 and (qkv_bias is not None or q_norm is not None or k_norm is not None):
        return None
    return dataclasses.replace(
        layer, qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm, window=options.sliding_window,
        scale=options.scale or 0.0, softcap=options.logit_softcap or 0.0, gelu=gelu, local_rope=local_rope,
    )


Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepEnds:
    """What LlamaModel.forward computes around the layers, for a whole step in
    one call (`DecodeStack.step`): the embedding table and its scale, the final
    norm, the rope tables by position (`local_rope`: Gemma 3's window layers')."""

    embed: torch.Tensor
    embed_scale: float | None
    final_norm: torch.Tensor
    final_eps: float
    rope: Rope
    local_rope: Rope | None


class FusedLayers(list[FusedLayer]):
    """LlamaModel.gather_fused_layers' layers; where every one is dense (no MoE
    block, whose routing runs in Python between the kernel's halves), also held
    once in a `kiln.DecodeStack`, so a step is one kernel call, not one per
    layer (whose arguments cost a 1-row step more than its small ops; see
    docs/benchmarks.md (One call per decode step)); with the step's `ends` that
    call also embeds, ropes and norms (`whole_steps`). Not to be changed after
    construction: the stack holds what the list held then."""

    def __init__(self, layers: list[FusedLayer], arch: ModelArch, ends: StepEnds | None = None):
        super().__init__(layers)
        self.stack = decode_stack(layers, arch)
        self.max_rows = row_limit(layers)
        self._ends_set = False
        if self.stack is not None and ends is not None and ends.final_norm.dtype == ends.embed.dtype:
            local = ends.local_rope or (torch.empty(0), torch.empty(0))
            self.stack.set_ends(ends.embed, ends.embed_scale or 0.0, ends.final_norm, ends.final_eps, *ends.rope,
                                *local)
            self._ends_set = True

    @property
    def whole_steps(self) -> bool:
        """A decode step is one `DecodeStack.step` call, ids to normed hidden states (see `step`)."""
        return self.stack is not None and self._ends_set


def row_limit(layers: list[FusedLayer]) -> int | None:
    """The most rows a decode-only step may have to take these layers (None: any):
    as many as the module path runs the fused layers' projection kernels for,
    so a step has the same bits either way, and the fused layers save the
    module path's per-layer Python (a 32-prompt decode run, Zen 4: 1.04-1.05x;
    48 rows, Zen 3: 1.02-1.20x). The least of the projections' own limits
    (`projection_row_limit`); a MoE layer's experts: packed_min_rows."""
    dtype = layers[0].input_norm.dtype if layers else torch.float32
    if not layers or any(f.moe is not None for f in layers):
        return packed_min_rows(dtype)
    limits = [projection_row_limit(p, f.group_size, dtype) for f in layers for p in (f.qkv, f.o, f.gate_up, f.down)]
    bounded = [n for n in limits if n is not None]
    return min(bounded) if bounded else None


def projection_row_limit(tensors: list[torch.Tensor], group_size: int, dtype: torch.dtype) -> int | None:
    """Rows up to which a projection's module (None: at any) runs the kernel
    decode_layer.cpp's `project` runs for it: int4 in lane layout
    (Int4LaneLinear), int8 rows (Int8Linear) and int4 on int8 activations
    one kernel at every row count; Kiln-format int4 in an fp32 model up to
    INT4_DEQUANT_MIN_ROWS (then kiln::linear_w4_panels); anything else
    up to packed_min_rows (then a packed copy's oneDNN)."""
    codes = tensors[0].dtype if len(tensors) > 1 else None  # lanes: [lanes, params] or with their bf16 copy
    if codes in (torch.int32, torch.int8) or (codes == torch.uint8 and group_size < 0):
        return None
    if codes == torch.uint8 and dtype == torch.float32:
        return INT4_DEQUANT_MIN_ROWS
    return packed_min_rows(dtype)


def decode_stack(layers: list[FusedLayer], arch: ModelArch) -> Any:
    """A kiln.DecodeStack holding the layers, or None where one does not apply (Any: mypy
    knows none of the TorchScript class's methods)."""
    if not layers or any(f.moe is not None for f in layers):
        return None
    stack = torch.classes.kiln.DecodeStack(
        arch.rms_norm_eps, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rotary_dim or 0
    )
    for f in layers:
        stack.add_layer(
            f.qkv, f.o, f.gate_up, f.down, f.group_size, f.input_norm, f.post_norm, f.qkv_bias, f.q_norm,
            f.k_norm, f.window, f.scale, f.softcap, f.attn_out_norm, f.mlp_out_norm, f.gelu, f.local_rope,
        )
    return stack


def applies(meta: AttentionMetadata, num_tokens: int, max_rows: int | None) -> bool:
    """A decode-only step of at most `max_rows` rows (the layers' row_limit; None: any)."""
    return not meta.prefills and meta.num_decodes == num_tokens and (max_rows is None or num_tokens <= max_rows)


def step(layers: FusedLayers, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
         meta: AttentionMetadata) -> torch.Tensor:
    """A decode-only step in one call (layers.whole_steps): the final norm's output, bit-identical to
    LlamaModel.forward's embedding, rope tables, `run` and final norm."""
    tables, lens = meta.decode_tables()
    return layers.stack.step(ids, positions, kv_caches[: len(layers)], meta.slot_mapping, [tables], [lens],
                             meta.block_size)


def run(
    layers: list[FusedLayer], arch: ModelArch, x: torch.Tensor, rope: Rope, kv_caches: list[torch.Tensor],
    meta: AttentionMetadata, local_rope: Rope,
) -> torch.Tensor:
    """The decoder layers over a decode-only step; returns the residual stream.
    `local_rope`: the tables of layers with `local_rope` (Gemma 3's window layers)."""
    a = arch
    # All rows in one kernel call per layer: Kiln's kernel reads each row's
    # context exactly, and one call shares the batch's work between threads
    # better than a call per group of 16 (1.05-1.13x at 40-64 rows on Zen 3).
    all_tables, all_lens = meta.decode_tables()
    tables, lens = [all_tables], [all_lens]
    stack = getattr(layers, "stack", None)
    if stack is not None:
        return stack.run(
            x, *rope, *local_rope, kv_caches[: len(layers)], meta.slot_mapping, tables, lens, meta.block_size
        )
    rotary_dim = a.rotary_dim or 0
    for f, kv_cache in zip(layers, kv_caches, strict=False):
        cos, sin = local_rope if f.local_rope else rope
        rest = (
            f.group_size, f.input_norm, f.post_norm, a.rms_norm_eps, cos, sin, kv_cache, meta.slot_mapping,
            tables, lens, meta.block_size, a.num_heads, a.num_kv_heads, a.head_dim, f.qkv_bias, f.q_norm,
            f.k_norm, rotary_dim, f.window, f.scale, f.softcap, f.attn_out_norm,
        )
        if f.moe is None:
            x = torch.ops.kiln.decode_layer(x, f.qkv, f.o, f.gate_up, f.down, *rest, f.mlp_out_norm, f.gelu)
        else:
            h, x = torch.ops.kiln.decode_attention(x, f.qkv, f.o, *rest)
            x = x + (moe_experts(f.moe, f, h) if f.gate_up else f.moe(h))
    return x


def moe_experts(moe: SparseMoeBlock, layer: FusedLayer, h: torch.Tensor) -> torch.Tensor:
    """moe(h) with the routing in Python and the experts in `kiln::moe_experts`."""
    ids, weights = moe.route(h)
    return torch.ops.kiln.moe_experts(h, ids, weights, layer.gate_up, layer.down, len(moe.experts), layer.group_size)
