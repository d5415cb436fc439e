"""Gemma 2 ((1+w) and sandwich norms, GeGLU, embedding scale, query_pre_attn_scalar,
soft-capped attention and logits, alternating sliding-window layers) against
transformers, and its GGUF."""
import pytest
from transformers import Gemma2Config, Gemma2ForCausalLM

from kiln import LLM
from kiln.llm.models.gemma import GemmaModel
from tests.unit.llm.models.families import tiny

# Caps small enough to bend these tiny models' scores and logits; a softmax
# scale other than head_dim ** -0.5 (query_pre_attn_scalar 32, head_dim 16).
GEMMA2 = dict(sliding_window=16, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
              query_pre_attn_scalar=32, num_hidden_layers=3, pad_token_id=0)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("gemma2"), Gemma2Config, Gemma2ForCausalLM, smollm2_tokenizer,
                           chat_template=tiny.TEMPLATES["gemma"], **GEMMA2)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_prompt_logits_match_transformers(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05)
    arch = llm.engine.arch
    assert arch.layer_windows == (16, 0, 16)  # the first layer slides, then every other
    assert (arch.attn_logit_softcap, arch.final_logit_softcap, arch.query_scale) == (1.0, 2.0, 32**-0.5)
    assert type(llm.engine.core.runner.model) is GemmaModel
    tiny.check_prompt_logits(llm, ref, atol=1e-4)


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    llm = tiny.check_engine_matches_hf(ref)
    # the fused decode layer takes the sandwich norms, GeGLU, scale and soft-cap
    assert llm.engine.core.runner.model.fused_layers is not None


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1)


def test_gguf_load_equals_safetensors(ref, tmp_path):
    conv = tiny.GGUFConversion("gemma2", norm_offset=1.0, keys={
        "add_sliding_window": 16, "add_attn_logit_softcapping": 1.0, "add_final_logit_softcapping": 2.0,
    })
    path = tiny.write_gguf(tmp_path / "gemma2.gguf", ref.directory, conv)
    # GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim (16) for every size but 27B.
    tiny.check_gguf_load_equals_safetensors(path, ref.directory, arch_differs={"query_scale": 16**-0.5})
