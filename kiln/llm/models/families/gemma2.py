"""Gemma 2: Gemma's layer (kiln/llm/models/gemma.py) with soft-capped
attention scores and final logits, and sliding-window attention on every
other layer (the first slides).

HF `Gemma2ForCausalLM`; GGUF `gemma2` (llama.cpp stores the norms as 1 + w;
the softmax scale is not stored: query_pre_attn_scalar is taken to be
head_dim, as llama.cpp does for every size but 27B, whose 46 layers use
hidden / heads). Kernels: norms, rotary, paged decode attention (window and
soft-cap), GeGLU, linear; not the fused decode layer.
"""
from __future__ import annotations

from typing import Any

from kiln.llm.models.arch import ModelArch
from kiln.llm.models.families.common import attention, embeddings_and_head, gated_mlp, layer_norms
from kiln.llm.models.gemma import GemmaModel
from kiln.llm.models.gguf_meta import GGUFMeta, GGUFNaming
from kiln.llm.models.hf_config import SLIDING, HFConfig
from kiln.llm.models.registry import Family
from kiln.llm.models.weight_map import WeightMap

GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
GEMMA_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma_fields(c: HFConfig) -> dict[str, Any]:
    """What Gemma 2 and 3 share: (1 + w) norms, sandwich norms, GeGLU, sqrt(hidden) embedding scale."""
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise c.fail(f"unsupported hidden_activation {act!r}")
    if c.get("attention_bias"):
        raise c.fail("unsupported attention biases")
    hidden = int(c.need("hidden_size"))
    return dict(
        norm_plus_one=True, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=hidden**0.5,
        query_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
    )


def alternating(layers: int, pattern: int) -> list[str]:
    """transformers' and llama.cpp's rule: every `pattern`-th layer is global, the others slide."""
    return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    layers = int(c.need("num_hidden_layers"))
    return ModelArch(
        **c.base_fields(extra_eos_ids, tied_by_default=True), **gemma_fields(c), family="gemma2",
        attn_logit_softcap=c.get("attn_logit_softcapping"), final_logit_softcap=c.get("final_logit_softcapping"),
        layer_windows=c.layer_windows(alternating(layers, 2)),
    )


def gguf_query_scale(meta: GGUFMeta, fields: dict[str, Any], layers_27b: int) -> float:
    if fields["num_layers"] == layers_27b:
        return float(fields["hidden_size"] // fields["num_heads"]) ** -0.5
    return float(fields["head_dim"]) ** -0.5


def arch_from_gguf(meta: GGUFMeta) -> ModelArch:
    meta.check_plain_rope()
    fields = meta.base_fields()
    layers = fields["num_layers"]
    return ModelArch(
        **fields, family="gemma2", norm_plus_one=True, sandwich_norms=True, hidden_act="gelu_tanh",
        embed_scale=fields["hidden_size"] ** 0.5, query_scale=gguf_query_scale(meta, fields, 46),
        attn_logit_softcap=_optional_float(meta.arch("attn_logit_softcapping", None)),
        final_logit_softcap=_optional_float(meta.arch("final_logit_softcapping", None)),
        layer_windows=meta.sliding_windows([t == SLIDING for t in alternating(layers, 2)]),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def weight_map(arch: ModelArch) -> WeightMap:
    m = WeightMap()
    embeddings_and_head(m, arch)
    for i in range(arch.num_layers):
        attention(m, arch, i)
        gated_mlp(m, arch, f"layers.{i}.mlp", f"model.layers.{i}.mlp", arch.intermediate_size)
        layer_norms(m, arch, i, GEMMA_NORMS)
    return m


def gguf_naming(arch: ModelArch) -> GGUFNaming:
    return GGUFNaming(GEMMA_GGUF_BLOCK_NAMES, norm_offset=1.0)


FAMILY = Family(
    name="gemma2",
    hf_architectures=("Gemma2ForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=weight_map,
    model_class=GemmaModel,
    gguf_architectures=("gemma2",),
    arch_from_gguf=arch_from_gguf,
    gguf_naming=gguf_naming,
)
