"""Gemma 3 (Gemma 2's layer with q/k norms, no soft-capping; sliding layers with
their own rope base, global layers with linear rope scaling) against
transformers, and its GGUF."""
import pytest
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from kiln import LLM
from kiln.llm.models.arch import LinearRopeScaling
from tests.unit.llm.models.families import tiny

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA3 = dict(
    sliding_window=16, num_hidden_layers=3, layer_types=LAYER_TYPES, query_pre_attn_scalar=16, pad_token_id=0,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, smollm2_tokenizer):
    directory = tiny.build(tmp_path_factory.mktemp("gemma3"), Gemma3TextConfig, Gemma3ForCausalLM,
                           smollm2_tokenizer, chat_template=tiny.TEMPLATES["gemma"], **GEMMA3)
    return tiny.Reference.of(directory, smollm2_tokenizer)


def test_prompt_logits_match_transformers(ref):
    llm = LLM(str(ref.directory), dtype="float32", kv_cache_memory_gib=0.05)
    arch = llm.engine.arch
    assert (arch.layer_windows, arch.qk_norm, arch.local_rope_theta) == ((16, 0, 16), True, 10_000.0)
    assert (arch.rope_theta, arch.rope_scaling) == (1_000_000.0, LinearRopeScaling(4.0))
    tiny.check_prompt_logits(llm, ref, atol=1e-4)


def test_engine_matches_transformers_with_caching_chunking_and_preemption(ref):
    llm = tiny.check_engine_matches_hf(ref)
    # the fused decode layer takes the sandwich norms, q/k norms and the local rope
    assert llm.engine.core.runner.model.fused_layers is not None


def test_speculative_decoding_and_int8(ref):
    tiny.check_speculative_decoding(ref)
    tiny.check_int8(ref, atol=0.1)


def test_gguf_load_equals_safetensors(ref, tmp_path):
    import gguf

    conv = tiny.GGUFConversion("gemma3", norm_offset=1.0, keys={
        "add_sliding_window": 16, "add_sliding_window_pattern": [t == LAYER_TYPES[0] for t in LAYER_TYPES],
        "add_rope_scaling_type": gguf.RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0,
    })
    path = tiny.write_gguf(tmp_path / "gemma3.gguf", ref.directory, conv)
    tiny.check_gguf_load_equals_safetensors(path, ref.directory)
