"""Phi-3 / Phi-4 (q|k|v and gate|up fused in the checkpoint, partial rotary,
sliding window, LongRoPE) against transformers, and its GGUF."""
import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from kiln import LLM
from kiln.llm.models.arch import LongRopeScaling
from tests.unit.llm.models.families import tiny

ROTARY = 8  # partial_rotary_factor 0.5 of head_dim 16, as Phi-4-mini rotates 3/4
LONG_ROPE = dict(
    rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.0, 4.0, 8.0],
    original_max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("phi3"), Phi3Config, Phi3ForCausalLM, smollm2_tokenizer,
                           chat_template=tiny.TEMPLATES["phi3"], partial_rotary_factor=0.5, sliding_window=16,
                           pad_token_id=0)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_prompt_logits_match_transformers(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05)
    arch = llm.engine.arch
    assert (arch.family, arch.rotary_dim, arch.layer_windows) == ("phi3", ROTARY, (16, 16))
    tiny.check_prompt_logits(llm, ref, atol=1e-4)


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    llm = tiny.check_engine_matches_hf(ref)
    assert llm.engine.core.runner.model.fused_layers is not None  # rotary_dim and window passed


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1)


def test_long_rope_matches_transformers_past_the_original_context(tmp_path, smollm2_tokenizer):
    """An engine whose context (512) exceeds original_max_position_embeddings (64) rotates with
    the long factors; transformers does too for a sequence longer than 64, which these are."""
    directory = tiny.build(tmp_path / "phi3_long", Phi3Config, Phi3ForCausalLM, smollm2_tokenizer,
                           partial_rotary_factor=0.5, rope_scaling=LONG_ROPE, pad_token_id=0,
                           original_max_position_embeddings=64)
    llm = LLM(str(directory), dtype="float32", kv_cache_memory_gib=0.05)
    scaling = llm.engine.arch.rope_scaling
    assert isinstance(scaling, LongRopeScaling) and scaling.attention_factor > 1  # sqrt(1 + ln 8 / ln 64)
    hf = tiny.hf_model(directory)
    long_prompts = [ids for ids in tiny.mixed_prompts(smollm2_tokenizer, 8) if len(ids) > 64]
    assert len(long_prompts) == 5  # 117..196 tokens
    for ids in long_prompts[:3]:
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).logits[0].float()
        assert (tiny.kiln_prompt_logits(llm, ids) - expected).abs().max().item() < 1e-4


def test_gguf_load_equals_safetensors(ref, tmp_path):
    conv = tiny.GGUFConversion("phi3", keys={"add_sliding_window": 16})
    path = tiny.write_gguf(tmp_path / "phi3.gguf", ref.directory, conv)
    tiny.check_gguf_load_equals_safetensors(path, ref.directory)
