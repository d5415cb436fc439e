"""`kv_cache_dtype`: what the paged pool stores, validated once in the config."""
from types import SimpleNamespace

import pytest
import torch

from kiln.config import EngineConfig
from kiln.errors import ConfigError
from kiln.llm.engine.builder import resolve_dtype
from kiln.llm.runner.model_runner import kv_bytes_per_block, kv_dtype


def test_auto_follows_the_model_dtype_and_a_name_overrides_it():
    assert kv_dtype(EngineConfig.from_flat(dtype="float32")) == torch.float32
    assert kv_dtype(EngineConfig.from_flat(dtype="bfloat16")) == torch.bfloat16
    assert kv_dtype(EngineConfig.from_flat(kv_cache_dtype="float16")) == torch.float16
    assert kv_dtype(EngineConfig.from_flat(dtype="float16", kv_cache_dtype="float32")) == torch.float32


@pytest.mark.parametrize(
    "options,gguf,expected",
    [
        (dict(dtype="float32"), True, "float16"),  # llama.cpp's default cache for a GGUF file
        (dict(dtype="float32"), False, "float32"),  # a float checkpoint keeps its precision
        (dict(dtype="bfloat16"), True, "bfloat16"),
        (dict(dtype="float32", kv_cache_dtype="float32"), True, "float32"),  # a name always wins
        (dict(dtype="float32", kv_cache_dtype="bfloat16"), False, "bfloat16"),
        (dict(dtype="float32", device="cuda"), True, "float32"),  # Kiln's CUDA kernels: the model's dtype
    ],
)
def test_resolving_auto_gives_a_gguf_file_in_float32_on_cpu_a_float16_pool(options, gguf, expected, caplog):
    with caplog.at_level("INFO", logger="kiln.llm.engine.builder"):
        config = resolve_dtype(EngineConfig.from_flat(**options), None, gguf=gguf)
    assert config.cache.kv_cache_dtype == expected
    assert kv_dtype(config) == getattr(torch, expected)
    assert f"KV pool {expected} (" in caplog.text  # serve and generate log the choice


def test_unknown_kv_cache_dtypes_are_rejected_by_name():
    with pytest.raises(ConfigError, match="must be one of auto, float32, float16, bfloat16, fp8_e4m3, got 'fp8'"):
        EngineConfig.from_flat(kv_cache_dtype="fp8")


def test_fp8_pool_is_e4m3_on_cuda_and_holds_four_times_an_fp32_pool():
    config = EngineConfig.from_flat(device="cuda", kv_cache_dtype="fp8_e4m3")
    assert kv_dtype(config) == torch.float8_e4m3fn
    model = SimpleNamespace(arch=SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64))
    assert kv_bytes_per_block(model, 16, torch.float8_e4m3fn) * 4 == kv_bytes_per_block(model, 16, torch.float32)


def test_a_16_bit_pool_fits_twice_the_blocks():
    model = SimpleNamespace(arch=SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64))
    assert kv_bytes_per_block(model, 16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4
    assert kv_bytes_per_block(model, 16, torch.float16) == kv_bytes_per_block(model, 16, torch.float32) // 2
