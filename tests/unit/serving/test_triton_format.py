"""A config read back in Triton's form (what GET .../config answers and tritonclient's
load_model(config=...) sends back) loads the model it describes."""
from __future__ import annotations

import json

import pytest

from kiln.errors import ConfigError
from kiln.frontends.kserve.documents import triton_config
from kiln.serving.repository.config import parse_config
from kiln.serving.repository.triton_format import from_triton, is_triton_form

PYTHON = {"backend": "python", "max_batch_size": 8, "instance_count": 2, "max_inline_ms": 0,
          "inputs": [{"name": "IN", "datatype": "FP32", "dims": [-1]}, {"name": "T", "datatype": "BYTES", "dims": [1],
                                                                         "optional": True}],
          "outputs": [{"name": "OUT", "datatype": "FP32", "dims": [-1]}],
          "dynamic_batching": {"max_queue_delay_ms": 2.5, "preferred_batch_sizes": [4], "variable_shapes": "pad",
                               "max_queue_size": 16, "default_timeout_ms": 100},
          "warmup": [{"inputs": {"IN": {"datatype": "FP32", "dims": [3]}}}],
          "version_policy": {"all": True}, "parameters": {"scale": 2.0, "verbose": True, "mode": "fast", "n": 3}}
ENSEMBLE = {"backend": "ensemble", "max_batch_size": 8,
            "inputs": [{"name": "A", "datatype": "FP32", "dims": [4]}],
            "outputs": [{"name": "S", "datatype": "FP32", "dims": [4]}],
            "steps": [{"model": "add_sub", "version": 2, "input_map": {"INPUT0": "A"}, "output_map": {"OUTPUT0": "S"}},
                      {"model": "doubler", "input_map": {"IN": "S"}, "output_map": {"OUT": "X"}}]}
LLM = {"backend": "llm", "max_batch_size": 16, "parameters": {"kv_cache_memory_gib": 0.5, "dtype": "auto"}}


def protobuf_json(doc):
    """As gRPC's JSON form writes it: int64 fields as strings."""
    def walk(value, key=""):
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, key) for v in value]
        if isinstance(value, int) and not isinstance(value, bool) and key in ("dims", "max_queue_delay_microseconds"):
            return str(value)
        return value
    return walk(doc)


@pytest.mark.parametrize("data", [PYTHON, ENSEMBLE, LLM], ids=["python", "ensemble", "llm"])
@pytest.mark.parametrize("form", [lambda d: d, protobuf_json], ids=["http", "grpc"])
def test_a_config_sent_back_unchanged_is_the_same_config(data, form):
    config = parse_config(data, name="m")
    doc = json.loads(json.dumps(form(triton_config(config))))
    assert is_triton_form(doc) and not is_triton_form(data)
    assert parse_config(from_triton(doc, config), name="m") == config


def test_edits_in_tritons_form_take_effect_and_kilns_own_settings_stay():
    config = parse_config(PYTHON, name="m")
    doc = triton_config(config)
    doc["max_batch_size"] = 32
    doc["dynamic_batching"]["max_queue_delay_microseconds"] = 5000
    doc["dynamic_batching"]["preferred_batch_size"] = [16, 32]
    doc["instance_group"][0]["count"] = 1
    doc["parameters"]["scale"] = {"string_value": "3.5"}
    edited = parse_config(from_triton(doc, config), name="m")
    assert (edited.max_batch_size, edited.instance_count, edited.parameters["scale"]) == (32, 1, 3.5)
    batching = edited.dynamic_batching
    assert (batching.max_queue_delay_ms, batching.preferred_batch_sizes, batching.variable_shapes) == (5.0, (16, 32),
                                                                                                       "pad")
    assert edited.warmup == config.warmup and edited.max_inline_ms == 0
    del doc["dynamic_batching"]  # Triton's meaning: no dynamic batching
    assert parse_config(from_triton(doc, config), name="m").dynamic_batching is None


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(sequence_batching={}), r"field\(s\) \['sequence_batching'\] are not supported"),
    (lambda d: d["input"][0].update(reshape={"shape": [2]}), r"input\[0\]: Triton tensor field\(s\) \['reshape'\]"),
    (lambda d: d.update(platform="tensorrt_plan", backend=None) or d.pop("backend"), "unknown platform"),
    (lambda d: d["parameters"].update(scale={"string_value": "abc"}), "parameters.scale must be a float"),
    (lambda d: d["input"][0].update(dims=["x"]), r"input\[0\].dims must be an integer"),
])
def test_what_kiln_cannot_take_is_named(change, message):
    config = parse_config(PYTHON, name="m")
    doc = triton_config(config)
    change(doc)
    with pytest.raises(ConfigError, match=message):
        from_triton(doc, config)
