"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse mixture-of-experts
MLP (kiln/llm/models/moe.py): softmax router, top-k (8 of 128), renormalised
when norm_topk_prob; layers in mlp_only_layers (or off the
decoder_sparse_step) keep a dense MLP.

HF `Qwen3MoeForCausalLM`; GGUF `qwen3moe` (experts stacked; llama.cpp
renormalises the top-k weights and has no dense layers). Kernels: as
Mixtral.
"""
from __future__ import annotations

from typing import Any

from kiln.llm.models.arch import ModelArch, MoEShape
from kiln.llm.models.families.common import (
    LLAMA_NORMS,
    attention,
    embeddings_and_head,
    gated_mlp,
    layer_norms,
    reject_biases,
    require_silu,
)
from kiln.llm.models.families.qwen2 import qwen_windows
from kiln.llm.models.gguf_meta import LLAMA_BLOCK_NAMES, GGUFMeta, GGUFNaming
from kiln.llm.models.hf_config import HFConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import Family
from kiln.llm.models.weight_map import WeightMap

GGUF_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    require_silu(c)
    reject_biases(c)
    layers = int(c.need("num_hidden_layers"))
    experts = int(c.get("num_experts") or c.need("num_local_experts"))
    step = int(c.get("decoder_sparse_step", 1))
    only_mlp = set(c.get("mlp_only_layers", []))
    # transformers: sparse where not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step)
    moe = MoEShape(
        num_experts=experts, top_k=int(c.need("num_experts_per_tok")),
        intermediate_size=int(c.need("moe_intermediate_size")),
        renormalize=bool(c.get("norm_topk_prob", False)), dense_layers=dense,
    )
    return ModelArch(
        **c.base_fields(extra_eos_ids), family="qwen3_moe", qk_norm=True, moe=moe, layer_windows=qwen_windows(c)
    )


def arch_from_gguf(meta: GGUFMeta) -> ModelArch:
    meta.check_plain_rope()
    fields = meta.base_fields()
    moe = MoEShape(
        num_experts=int(meta.arch("expert_count")), top_k=int(meta.arch("expert_used_count")),
        intermediate_size=int(meta.arch("expert_feed_forward_length")),
        renormalize=bool(meta.arch("expert_weights_norm", True)),
    )
    return ModelArch(**fields, family="qwen3_moe", qk_norm=True, moe=moe)


def weight_map(arch: ModelArch) -> WeightMap:
    if arch.moe is None:
        raise ValueError("a Qwen3-MoE arch has a MoE shape")
    m = WeightMap()
    embeddings_and_head(m, arch)
    for i in range(arch.num_layers):
        attention(m, arch, i)
        p = f"model.layers.{i}.mlp"
        if arch.is_moe_layer(i):
            m.add(f"layers.{i}.mlp.router_weight", (p + ".gate.weight", (arch.moe.num_experts, arch.hidden_size)))
            for e in range(arch.moe.num_experts):
                gated_mlp(m, arch, f"layers.{i}.mlp.experts.{e}", f"{p}.experts.{e}", arch.moe.intermediate_size)
        else:
            gated_mlp(m, arch, f"layers.{i}.mlp", p, arch.intermediate_size)
        layer_norms(m, arch, i, LLAMA_NORMS)
    return m


def gguf_naming(arch: ModelArch) -> GGUFNaming:
    return GGUFNaming({**LLAMA_BLOCK_NAMES, "ffn_gate_inp": "mlp.gate"}, experts=GGUF_EXPERTS)


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=weight_map,
    model_class=LlamaModel,
    gguf_architectures=("qwen3moe",),
    arch_from_gguf=arch_from_gguf,
    gguf_naming=gguf_naming,
)
