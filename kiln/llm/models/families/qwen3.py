"""Qwen3 (dense): Llama with an RMSNorm over each head of q and k before rope.

HF `Qwen3ForCausalLM`; GGUF `qwen3`. Kernels: every op and the fused decode
layer (q/k norms passed).
"""
from __future__ import annotations

from typing import Any

from kiln.llm.models.arch import ModelArch
from kiln.llm.models.families.common import llama_weight_map, reject_biases, require_silu
from kiln.llm.models.families.qwen2 import gguf_naming, qwen_windows
from kiln.llm.models.gguf_meta import GGUFMeta
from kiln.llm.models.hf_config import HFConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import Family


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    require_silu(c)
    reject_biases(c)  # Qwen3's attention_bias would bias o_proj too
    return ModelArch(**c.base_fields(extra_eos_ids), family="qwen3", qk_norm=True, layer_windows=qwen_windows(c))


def arch_from_gguf(meta: GGUFMeta) -> ModelArch:
    meta.check_plain_rope()
    return ModelArch(**meta.base_fields(), family="qwen3", qk_norm=True)


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=llama_weight_map,
    model_class=LlamaModel,
    gguf_architectures=("qwen3",),
    arch_from_gguf=arch_from_gguf,
    gguf_naming=gguf_naming,
)
