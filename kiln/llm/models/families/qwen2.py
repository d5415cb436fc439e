"""Qwen2 / Qwen2.5: Llama with q/k/v biases (and a sliding window on the
upper layers only when use_sliding_window, which released models leave off).

HF `Qwen2ForCausalLM`; GGUF `qwen2` (no Q/K permutation: llama.cpp rotates
halves for it, like transformers). Kernels: every op and the fused decode
layer (bias passed).
"""
from __future__ import annotations

from typing import Any

from kiln.llm.models.arch import ModelArch
from kiln.llm.models.families.common import llama_weight_map, require_silu
from kiln.llm.models.gguf_meta import LLAMA_BLOCK_NAMES, GGUFMeta, GGUFNaming
from kiln.llm.models.hf_config import SLIDING, HFConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import Family


def qwen_windows(c: HFConfig) -> tuple[int, ...]:
    """transformers' rule: layers from max_window_layers up slide, only with use_sliding_window."""
    if not c.get("use_sliding_window", False):
        return ()
    layers = int(c.need("num_hidden_layers"))
    first = int(c.get("max_window_layers", layers))
    return c.layer_windows([SLIDING if i >= first else "full_attention" for i in range(layers)])


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    require_silu(c)
    return ModelArch(
        **c.base_fields(extra_eos_ids), family="qwen2", attention_bias=True, layer_windows=qwen_windows(c)
    )


def arch_from_gguf(meta: GGUFMeta) -> ModelArch:
    meta.check_plain_rope()
    return ModelArch(**meta.base_fields(), family="qwen2", attention_bias=True)


def gguf_naming(arch: ModelArch) -> GGUFNaming:
    return GGUFNaming(LLAMA_BLOCK_NAMES)


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=llama_weight_map,
    model_class=LlamaModel,
    gguf_architectures=("qwen2",),
    arch_from_gguf=arch_from_gguf,
    gguf_naming=gguf_naming,
)
