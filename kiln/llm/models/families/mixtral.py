"""Mixtral: Llama's attention with a sparse mixture-of-experts MLP in every
layer (kiln/llm/models/moe.py): softmax router, top-k (2 of 8), the chosen
probabilities renormalised to sum to one.

HF `MixtralForCausalLM` (experts as block_sparse_moe.experts.N.w1/w2/w3);
GGUF: llama.cpp writes Mixtral as `llama` with `expert_count` and the
experts stacked (ffn_gate_exps, ffn_up_exps, ffn_down_exps); the llama
family reads those files into this family. Kernels: norms, rotary, paged
attention, SwiGLU and the linear kernels (per expert, over its rows); decode
steps run each layer's attention half in one call (kiln::decode_attention,
see fused_decode.py) and the MoE block in Python.
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
from kiln.llm.models.gguf_meta import LLAMA_BLOCK_NAMES, GGUFNaming
from kiln.llm.models.hf_config import HFConfig
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.registry import Family
from kiln.llm.models.weight_map import WeightMap

# The experts' checkpoint names; stacked in GGUF.
GGUF_EXPERTS = {
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}


def arch_from_hf(config: dict[str, Any], source: str, extra_eos_ids: tuple[int, ...]) -> ModelArch:
    c = HFConfig(config, source)
    require_silu(c)
    reject_biases(c)
    fields = c.base_fields(extra_eos_ids)
    moe = MoEShape(
        num_experts=int(c.need("num_local_experts")), top_k=int(c.need("num_experts_per_tok")),
        intermediate_size=fields["intermediate_size"], renormalize=True,
    )
    return ModelArch(**fields, family="mixtral", moe=moe, layer_windows=c.layer_windows())


def weight_map(arch: ModelArch) -> WeightMap:
    if arch.moe is None:
        raise ValueError("a Mixtral arch has a MoE shape")
    m = WeightMap()
    embeddings_and_head(m, arch)
    for i in range(arch.num_layers):
        attention(m, arch, i)
        p = f"model.layers.{i}.block_sparse_moe."
        m.add(f"layers.{i}.mlp.router_weight", (p + "gate.weight", (arch.moe.num_experts, arch.hidden_size)))
        for e in range(arch.moe.num_experts):
            gated_mlp(m, arch, f"layers.{i}.mlp.experts.{e}", f"{p}experts.{e}", arch.moe.intermediate_size,
                      names=("w1", "w3", "w2"))
        layer_norms(m, arch, i, LLAMA_NORMS)
    return m


def gguf_naming(arch: ModelArch) -> GGUFNaming:
    names = {**LLAMA_BLOCK_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"}
    return GGUFNaming(names, experts=GGUF_EXPERTS, permute_qk=True)


FAMILY = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    arch_from_hf=arch_from_hf,
    weight_map=weight_map,
    model_class=LlamaModel,
    gguf_naming=gguf_naming,
)
