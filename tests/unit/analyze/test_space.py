"""Search spaces: what is searched per model kind, and how a choice becomes a config."""

from __future__ import annotations

import pytest

from kiln.analyze.space import (
    apply_llm,
    apply_repository,
    llm_space,
    parse_overrides,
    preferred_sizes,
    repository_space,
)
from kiln.config import EngineConfig
from kiln.errors import ConfigError
from kiln.serving.repository.config import parse_config

TABULAR = {
    "backend": "onnxruntime", "max_batch_size": 64,
    "dynamic_batching": {"max_queue_delay_ms": 2, "preferred_batch_sizes": [16, 32], "max_queue_size": 1024},
    "parameters": {"intra_op_num_threads": 1},
}


def test_repository_space_starts_from_the_config_yaml():
    space = repository_space(TABULAR)
    assert [p.name for p in space.params] == [
        "max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes", "instance_count", "intra_op_num_threads"]
    assert space.base == {"max_batch_size": 64, "max_queue_delay_ms": 2.0, "preferred_batch_sizes": "16,32",
                          "instance_count": 1, "intra_op_num_threads": 1}
    assert space.param("preferred_batch_sizes").values == ("none", "max", "pow2", "16,32")
    assert space.param("max_batch_size").ordered


def test_applying_a_choice_keeps_the_rest_of_the_config():
    space = repository_space(TABULAR)
    choice = {**space.base, "max_batch_size": 128, "preferred_batch_sizes": "pow2", "instance_count": 2}
    raw = apply_repository(TABULAR, choice)
    config = parse_config(raw, name="breast_cancer")
    assert config.max_batch_size == 128 and config.instance_count == 2
    assert config.dynamic_batching.preferred_batch_sizes == (32, 64, 128)
    assert config.dynamic_batching.max_queue_size == 1024  # untouched
    assert TABULAR["max_batch_size"] == 64  # the input is not changed
    # the base's own preferred sizes do not fit a smaller max batch: an invalid choice, refused by the config
    with pytest.raises(ConfigError, match="exceed max_batch_size"):
        parse_config(apply_repository(TABULAR, {**space.base, "max_batch_size": 8}), name="m")


def test_preferred_sizes():
    assert preferred_sizes("none", 64) == ()
    assert preferred_sizes("max", 64) == (64,)
    assert preferred_sizes("pow2", 64) == (16, 32, 64)
    assert preferred_sizes("pow2", 2) == (1, 2)
    assert preferred_sizes("16,32", 64) == (16, 32)


def test_a_model_without_batching_searches_instances_only():
    space = repository_space({"backend": "python"})
    assert [p.name for p in space.params] == ["instance_count"]


@pytest.mark.parametrize("backend", ["ensemble", "llm"])
def test_ensembles_and_llm_repository_models_are_refused_with_a_reason(backend):
    with pytest.raises(ConfigError, match="analyze"):
        repository_space({"backend": backend})


def test_llm_space_base_is_the_engine_defaults_plus_given_flags():
    space = llm_space({"max_num_seqs": 32})
    defaults = EngineConfig()
    assert space.base["max_num_seqs"] == 32
    assert space.base["max_num_batched_tokens"] == defaults.scheduler.max_num_batched_tokens
    assert space.base["quantization"] is None and space.base["spec_method"] is None
    assert "fp8_e4m3" not in space.param("kv_cache_dtype").values  # CUDA only
    assert apply_llm({"max_num_seqs": 32}, {**space.base, "quantization": "int8"}) == {
        "max_num_seqs": 32, "quantization": "int8"}


def test_llm_choices_are_validated_by_the_engine_config():
    with pytest.raises(ConfigError, match="fp8_e4m3"):
        apply_llm({}, {"kv_cache_dtype": "fp8_e4m3"})


def test_param_overrides_restrict_the_space_and_keep_the_base_value():
    space = repository_space(TABULAR)
    restricted = space.restricted(parse_overrides(space, ["max_batch_size=8,32", "max_queue_delay_ms=0"]))
    assert [(p.name, p.values) for p in restricted.params] == [
        ("max_batch_size", (8, 32, 64)), ("max_queue_delay_ms", (0.0, 2.0))]
    assert restricted.size() == 6
    with pytest.raises(ConfigError, match="unknown parameter 'batch'"):
        parse_overrides(space, ["batch=1"])
    with pytest.raises(ConfigError, match="takes numbers"):
        parse_overrides(space, ["max_batch_size=big"])
    llm = llm_space({})
    assert parse_overrides(llm, ["quantization=none,int8", "enable_chunked_prefill=off"]) == {
        "quantization": (None, "int8"), "enable_chunked_prefill": (False,)}
