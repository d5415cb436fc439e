"""Gemma 3 (text): Gemma 2's layer without soft-capping, plus q/k norms;
five of every six layers slide (with their own rope base, 10000, unscaled),
the sixth is global (rope_theta, with linear scaling on the larger models).

HF `Gemma3ForCausalLM` (the text-only checkpoints, e.g. gemma-3-1b; the
multimodal Gemma3ForConditionalGeneration is not read); GGUF `gemma3` (the
sliding layers' rope base is not stored: llama.cpp fixes it at 10000, as
here; 27B's 62 layers scale queries by hidden / heads). Kernels: as Gemma 2.
"""
from __future__ import annotations

from typing import Any

from kiln.llm.models.arch import LinearRopeScaling, ModelArch
from kiln.llm.models.families.gemma2 import (
    alternating,
    gemma_fields,
    gguf_naming,
    gguf_query_scale,
    weight_map,
)
from kiln.llm.models.gemma import GemmaModel
from kiln.llm.models.gguf_meta import GGUFMeta
from kiln.llm.models.hf_config import SLIDING, HFConfig
from kiln.llm.models.registry import Family

LOCAL_ROPE_THETA = 10000.0  # transformers' and llama.cpp's default for the sliding layers


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    if c.get("attn_logit_softcapping") is not None:
        raise c.fail("unsupported attn_logit_softcapping for Gemma 3")
    layers = int(c.need("num_hidden_layers"))
    nested = c.get("rope_parameters", {})
    local = nested.get(SLIDING) if isinstance(nested.get(SLIDING), dict) else {}
    if local.get("rope_type", "default") != "default":
        raise c.fail("unsupported rope scaling on the sliding-window layers")
    local_theta = float(local.get("rope_theta") or c.get("rope_local_base_freq", LOCAL_ROPE_THETA))
    fields = c.base_fields(extra_eos_ids, layer_type="full_attention", tied_by_default=True)
    if "rope_theta" not in c.rope_parameters("full_attention"):
        fields["rope_theta"] = 1_000_000.0  # Gemma3TextConfig's default for the global layers
    return ModelArch(
        **fields, **gemma_fields(c), family="gemma3", qk_norm=True, local_rope_theta=local_theta,
        final_logit_softcap=c.get("final_logit_softcapping"),
        layer_windows=c.layer_windows(alternating(layers, int(c.get("sliding_window_pattern", 6)))),
    )


def arch_from_gguf(meta: GGUFMeta) -> ModelArch:
    fields = meta.base_fields()
    scaling = meta.arch("rope.scaling.type", "none")
    if scaling == "linear":
        fields["rope_scaling"] = LinearRopeScaling(float(meta.arch("rope.scaling.factor")))
    elif scaling != "none":
        raise meta.fail(f"unsupported rope scaling type {scaling!r}")
    layers = fields["num_layers"]
    pattern = meta.arch("attention.sliding_window_pattern", 6)  # every n-th layer global, or a bool per layer
    sliding = [bool(p) for p in pattern] if isinstance(pattern, list) else [
        t == SLIDING for t in alternating(layers, int(pattern))
    ]
    if len(sliding) != layers:
        raise meta.fail(f"sliding_window_pattern has {len(sliding)} entries for {layers} layers")
    final_cap = meta.arch("final_logit_softcapping", None)
    return ModelArch(
        **fields, family="gemma3", qk_norm=True, norm_plus_one=True, sandwich_norms=True, hidden_act="gelu_tanh",
        embed_scale=fields["hidden_size"] ** 0.5, query_scale=gguf_query_scale(meta, fields, 62),
        local_rope_theta=LOCAL_ROPE_THETA, final_logit_softcap=None if final_cap is None else float(final_cap),
        layer_windows=meta.sliding_windows(sliding),
    )


FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=weight_map,
    model_class=GemmaModel,
    gguf_architectures=("gemma3",),
    arch_from_gguf=arch_from_gguf,
    gguf_naming=gguf_naming,
)
