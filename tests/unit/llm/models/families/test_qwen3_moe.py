"""Qwen3-MoE (q/k norms; top-2 of 4 experts without renormalisation; a dense
layer from mlp_only_layers) against transformers, and its GGUF."""
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from kiln import LLM
from kiln.llm.models.mlp import LlamaMLP
from kiln.llm.models.moe import SparseMoeBlock
from tests.unit.llm.models.families import tiny

QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                 mlp_only_layers=[1], tie_word_embeddings=False)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("qwen3moe"), Qwen3MoeConfig, Qwen3MoeForCausalLM,
                           smollm2_tokenizer, chat_template=tiny.TEMPLATES["chatml"], **QWEN3_MOE)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_prompt_logits_match_transformers(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05)
    layers = llm.engine.core.runner.model.layers
    assert isinstance(layers[0].mlp, SparseMoeBlock) and type(layers[1].mlp) is LlamaMLP
    fused = llm.engine.core.runner.model.fused_layers  # decode: attention fused, MoE block between
    assert fused is not None and [f.moe is not None for f in fused[:2]] == [True, False]
    tiny.check_prompt_logits(llm, ref, atol=1e-4)


def test_routing_without_renormalisation(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.01)
    block = llm.engine.core.runner.model.layers[0].mlp
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, hf_weights, hf_ids = ref.model.model.layers[0].mlp.gate(x)
        ids, weights = block.route(x)
    assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_weights, atol=1e-6)
    assert (weights.sum(-1) < 1 - 1e-3).all()  # the top 2 of 4 softmax probabilities, as they are


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    tiny.check_engine_matches_hf(ref)


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1, share=0.9)


def test_gguf_load_equals_safetensors(tmp_path, smollm2_tokenizer):
    """llama.cpp's qwen3moe has every layer sparse and renormalises: a checkpoint of that shape."""
    directory = tiny.build(tmp_path / "hf", Qwen3MoeConfig, Qwen3MoeForCausalLM, smollm2_tokenizer,
                           **{**QWEN3_MOE, "norm_topk_prob": True, "mlp_only_layers": []})
    conv = tiny.GGUFConversion("qwen3moe", keys={
        "add_expert_count": 4, "add_expert_used_count": 2, "add_expert_feed_forward_length": 32,
    })
    path = tiny.write_gguf(tmp_path / "qwen3moe.gguf", directory, conv)
    tiny.check_gguf_load_equals_safetensors(path, directory)
