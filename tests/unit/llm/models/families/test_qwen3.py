"""Qwen3 (q/k RMSNorm per head) against transformers, and its GGUF."""
import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from kiln import LLM
from tests.unit.llm.models.families import tiny


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("qwen3"), Qwen3Config, Qwen3ForCausalLM, smollm2_tokenizer,
                           chat_template=tiny.TEMPLATES["chatml"], tie_word_embeddings=False)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_prompt_logits_match_transformers(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05)
    assert (llm.engine.arch.family, llm.engine.arch.qk_norm) == ("qwen3", True)
    tiny.check_prompt_logits(llm, ref, atol=1e-4)


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    llm = tiny.check_engine_matches_hf(ref)
    assert llm.engine.core.runner.model.fused_layers is not None  # the fused decode layer takes the q/k norms


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1)


def test_gguf_load_equals_safetensors(ref, tmp_path):
    path = tiny.write_gguf(tmp_path / "qwen3.gguf", ref.directory, tiny.GGUFConversion("qwen3"))
    tiny.check_gguf_load_equals_safetensors(path, ref.directory)
