"""Qwen2 / Qwen2.5 (q/k/v biases) against transformers, and its GGUF."""
import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from kiln import LLM
from tests.unit.llm.models.families import tiny


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("qwen2"), Qwen2Config, Qwen2ForCausalLM, smollm2_tokenizer,
                           chat_template=tiny.TEMPLATES["chatml"], tie_word_embeddings=True)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_arch(ref):
    arch = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.01).engine.arch
    assert (arch.family, arch.attention_bias, arch.layer_windows) == ("qwen2", True, ())


def test_prompt_logits_match_transformers(ref):
    tiny.check_prompt_logits(LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05), ref, atol=1e-4)


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    llm = tiny.check_engine_matches_hf(ref)
    assert llm.engine.core.runner.model.fused_layers is not None  # the fused decode layer takes the biases


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1)


def test_gguf_load_equals_safetensors(ref, tmp_path):
    path = tiny.write_gguf(tmp_path / "qwen2.gguf", ref.directory, tiny.GGUFConversion("qwen2"))
    tiny.check_gguf_load_equals_safetensors(path, ref.directory)
