"""Mixtral (sparse MoE: softmax router, top-2 of 4, renormalised) against
transformers, and its GGUF (llama.cpp's `llama` with stacked experts)."""
import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from kiln import LLM
from kiln.llm.models.moe import SparseMoeBlock
from tests.unit.llm.models.families import tiny

MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("mixtral"), MixtralConfig, MixtralForCausalLM,
                           smollm2_tokenizer, chat_template=tiny.TEMPLATES["mistral"], **MIXTRAL)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_prompt_logits_match_transformers(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05)
    moe = llm.engine.arch.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.renormalize) == (4, 2, True)
    assert llm.engine.core.runner.model.fused_layers is not None  # decode: attention fused, MoE block between
    tiny.check_prompt_logits(llm, ref, atol=1e-4)


def test_routing_matches_transformers_router(ref):
    """Same experts and weights per token as transformers' MixtralTopKRouter."""
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.01)
    block = llm.engine.core.runner.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    hf_router = ref.model.model.layers[0].mlp.gate
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, hf_weights, hf_ids = hf_router(x)
        ids, weights = block.route(x)
    assert torch.equal(ids, hf_ids)
    assert torch.allclose(weights, hf_weights, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(50), atol=1e-6)  # renormalised


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    tiny.check_engine_matches_hf(ref)


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1, share=0.9)


def test_gguf_load_equals_safetensors(ref, tmp_path):
    conv = tiny.GGUFConversion("llama", permute_qk=True, keys={"add_expert_count": 4, "add_expert_used_count": 2})
    path = tiny.write_gguf(tmp_path / "mixtral.gguf", ref.directory, conv)
    tiny.check_gguf_load_equals_safetensors(path, ref.directory)
