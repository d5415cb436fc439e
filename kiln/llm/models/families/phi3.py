"""Phi-3 / Phi-3.5 / Phi-4 (and Phi-4-mini): Llama with q|k|v and gate|up
stored fused in the checkpoint, LongRoPE scaling (the 128k variants), an
optional sliding window (Phi-3-mini) and partial rotary (Phi-4-mini: the
first 3/4 of each head).

HF `Phi3ForCausalLM`; GGUF `phi3` (rope factors as `rope_factors_long` /
`rope_factors_short` tensors, the cos/sin multiplier as
`rope.scaling.attn_factor`). Kernels: every op and the fused decode layer
(window and rotary_dim passed).
"""
from __future__ import annotations

import math
from typing import Any

from kiln.llm.models.arch import LongRopeScaling, ModelArch
from kiln.llm.models.families.common import llama_weight_map, require_silu
from kiln.llm.models.gguf_meta import LLAMA_BLOCK_NAMES, GGUFMeta, GGUFNaming
from kiln.llm.models.hf_config import HFConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import Family
from kiln.llm.models.weight_map import WeightMap


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    require_silu(c)
    return ModelArch(**c.base_fields(extra_eos_ids), family="phi3", layer_windows=c.layer_windows())


def arch_from_gguf(meta: GGUFMeta) -> ModelArch:
    fields = meta.base_fields()
    scaling = None
    if meta.has_tensor("rope_factors_long.weight"):
        original = int(meta.arch("rope.scaling.original_context_length"))
        factor = fields["max_position_embeddings"] / original
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        scaling = LongRopeScaling(
            short_factor=meta.tensor_values("rope_factors_short.weight"),
            long_factor=meta.tensor_values("rope_factors_long.weight"),
            original_max_position_embeddings=original,
            attention_factor=float(meta.arch("rope.scaling.attn_factor", default)),
        )
    windows = meta.sliding_windows([True] * fields["num_layers"])
    return ModelArch(**{**fields, "rope_scaling": scaling}, family="phi3", layer_windows=windows)


def weight_map(arch: ModelArch) -> WeightMap:
    return llama_weight_map(arch, fused=True)


def gguf_naming(arch: ModelArch) -> GGUFNaming:
    names = {**LLAMA_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
    return GGUFNaming(names, metadata_tensors=("rope_factors_long", "rope_factors_short"))


FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=weight_map,
    model_class=LlamaModel,
    gguf_architectures=("phi3",),
    arch_from_gguf=arch_from_gguf,
    gguf_naming=gguf_naming,
)
