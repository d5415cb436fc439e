"""Mistral: Llama with an optional sliding window on every layer.

HF `MistralForCausalLM`. llama.cpp converts Mistral to GGUF `llama` (read by
the llama family, window included when the file states one). The window is
a mask in the attention backends (docs/models.md (Sliding-window
attention)). Kernels: every op and the fused decode layer (window passed).
"""
from __future__ import annotations

from typing import Any

from kiln.llm.models.arch import ModelArch
from kiln.llm.models.families.common import llama_weight_map, reject_biases, require_silu
from kiln.llm.models.families.llama import gguf_naming
from kiln.llm.models.hf_config import HFConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import Family


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    require_silu(c)
    reject_biases(c)
    if c.get("layer_types"):  # Ministral's alternating layers are another architecture
        raise c.fail("unsupported layer_types for MistralForCausalLM")
    return ModelArch(**c.base_fields(extra_eos_ids), family="mistral", layer_windows=c.layer_windows())


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=llama_weight_map,
    model_class=LlamaModel,
    gguf_naming=gguf_naming,
    # Sharded like Llama when no layer slides (the sharded layer takes no window).
    tensor_parallel=True,
)
