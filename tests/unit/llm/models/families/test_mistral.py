"""Mistral with sliding-window attention (a window of 16 tokens, prompts up to
~200) against transformers; its GGUF is llama.cpp's `llama` with the window."""
import pytest
from transformers import MistralConfig, MistralForCausalLM

from kiln import LLM
from tests.unit.llm.models.families import tiny

WINDOW = 16


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("mistral"), MistralConfig, MistralForCausalLM,
                           smollm2_tokenizer, chat_template=tiny.TEMPLATES["mistral"], sliding_window=WINDOW)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_prompt_logits_match_transformers(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05)
    assert llm.engine.arch.layer_windows == (WINDOW, WINDOW)
    tiny.check_prompt_logits(llm, ref, atol=1e-4)


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    llm = tiny.check_engine_matches_hf(ref)
    assert llm.engine.core.runner.model.fused_layers is not None  # the fused decode layer takes the window


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1)


def test_gguf_load_equals_safetensors(ref, tmp_path):
    conv = tiny.GGUFConversion("llama", permute_qk=True, keys={"add_sliding_window": WINDOW})
    path = tiny.write_gguf(tmp_path / "mistral.gguf", ref.directory, conv)
    # llama.cpp writes Mistral as "llama": the file is read by the llama family (same weight names).
    tiny.check_gguf_load_equals_safetensors(path, ref.directory, arch_differs={"family": "llama"})
