"""Llama (Llama 2/3.x, SmolLM, ...): the base every other family varies.

HF `LlamaForCausalLM`; GGUF `llama` (llama.cpp also writes Mistral and,
with experts, Mixtral under it: a `llama` file with `expert_count` is read
as Mixtral). Kernels: every op, and the one-call fused decode layer.
"""
from __future__ import annotations

from typing import Any

from kiln.llm.models.arch import ModelArch, MoEShape
from kiln.llm.models.families.common import llama_weight_map, reject_biases, require_silu
from kiln.llm.models.gguf_meta import LLAMA_BLOCK_NAMES, GGUFMeta, GGUFNaming
from kiln.llm.models.hf_config import HFConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import Family


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    require_silu(c)
    reject_biases(c)
    return ModelArch(**c.base_fields(extra_eos_ids), family="llama")


def arch_from_gguf(meta: GGUFMeta) -> ModelArch:
    meta.check_plain_rope()
    fields = meta.base_fields()
    if fields["rotary_dim"] is not None:  # partial rotary embedding: not plain Llama
        raise meta.fail(f"unsupported rope.dimension_count {fields['rotary_dim']} != head_dim {fields['head_dim']}")
    windows = meta.sliding_windows([True] * fields["num_layers"])
    experts = int(meta.arch("expert_count", 0) or 0)
    if not experts:
        return ModelArch(**fields, family="llama", layer_windows=windows)
    # Mixtral: every layer sparse, each expert as wide as feed_forward_length, top-k renormalised.
    moe = MoEShape(experts, int(meta.arch("expert_used_count")), fields["intermediate_size"], renormalize=True)
    return ModelArch(**fields, family="mixtral", layer_windows=windows, moe=moe)


def gguf_naming(arch: ModelArch) -> GGUFNaming:
    return GGUFNaming(LLAMA_BLOCK_NAMES, permute_qk=True)


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=llama_weight_map,
    model_class=LlamaModel,
    gguf_architectures=("llama",),
    arch_from_gguf=arch_from_gguf,
    gguf_naming=gguf_naming,
    tensor_parallel=True,
)
