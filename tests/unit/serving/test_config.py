import pytest
from pydantic import ValidationError

from kiln.errors import ConfigError
from kiln.serving.repository.config import MAX_WARMUP_ELEMENTS, VersionPolicy, check_model_name, parse_config


def _base(**kw):
    return {"backend": "python", "inputs": [{"name": "X", "datatype": "FP32", "dims": [-1]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "dims": [-1]}], **kw}


def test_valid_config_is_frozen():
    config = parse_config(_base(max_batch_size=4, dynamic_batching={"max_queue_delay_ms": 2}), name="m")
    assert config.name == "m" and config.max_batch_size == 4
    assert config.dynamic_batching.max_queue_delay_ms == 2
    with pytest.raises(ValidationError):
        config.max_batch_size = 3


_ENSEMBLE = {"backend": "ensemble", "inputs": [{"name": "A", "datatype": "FP32", "dims": [4]}],
             "outputs": [{"name": "S", "datatype": "FP32", "dims": [4]}],
             "steps": [{"model": "add_sub", "input_map": {"INPUT0": "A"}, "output_map": {"OUTPUT0": "S"}}]}


@pytest.mark.parametrize("data, fragment", [
    (_base(unknown_key=1), "unknown_key"),
    (_base(dynamic_batching={"max_queue_delay_ms": 1, "bogus": 2}), "bogus"),
    (_base(backend="tensorflow"), "backend"),
    (_base(inputs=[{"name": "X", "datatype": "FLOAT", "dims": [1]}]), "datatype"),
    (_base(inputs=[{"name": "X", "datatype": "FP32", "dims": [0]}]), "dims"),
    (_base(dynamic_batching={}), "max_batch_size"),
    (_base(max_batch_size=2, dynamic_batching={"preferred_batch_sizes": [4]}), "preferred"),
    (_base(artifact="../evil.py"), "artifact"),
    (_base(version_policy={"latest": 1, "all": True}), "one of"),
    (_base(inputs=[{"name": "X", "datatype": "FP32", "dims": [1]}] * 2), "duplicate"),
    (_base(steps=[{"model": "a", "input_map": {}, "output_map": {}}]), "ensemble"),
    ({"backend": "ensemble", "steps": []}, "ensemble"),
    # Settings a backend would accept and ignore (a step version of 0 meant "latest"):
    ({**_ENSEMBLE, "steps": [{**_ENSEMBLE["steps"][0], "version": 0}]}, "greater than or equal to 1"),
    ({**_ENSEMBLE, "instance_count": 2, "queue": {"max_queue_size": 4}},
     "instance_count, queue do nothing for backend 'ensemble'"),
    ({"backend": "llm", "device": "cuda"}, "device does nothing for backend 'llm' (its engine queues and batches "
                                           "the requests; its device is parameters.device)"),
    ({"backend": "llm", "max_inline_ms": 0}, "max_inline_ms does nothing for backend 'llm'"),
])
def test_invalid_configs_are_rejected(data, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(data, name="m")
    assert fragment in info.value.message


def test_name_must_match_directory():
    with pytest.raises(ConfigError, match="does not match"):
        parse_config(_base(name="other"), name="m")


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "", "a" * 200, "x\x00"])
def test_model_names_reject_traversal(name):
    with pytest.raises(ConfigError):
        check_model_name(name)


def test_version_policies():
    assert VersionPolicy().select([3, 1, 2]) == [3]
    assert VersionPolicy(latest=2).select([3, 1, 2]) == [2, 3]
    assert VersionPolicy(all=True).select([3, 1]) == [1, 3]
    assert VersionPolicy(specific=(1, 5)).select([1, 2, 3]) == [1]


def _warm(batch_size=1, **inputs):
    return [{"name": "w", "batch_size": batch_size, "inputs": inputs or {"X": {"datatype": "FP32", "dims": [2]}}}]


@pytest.mark.parametrize("warmup, fragments", [
    (_warm(X={"datatype": "FLOAT", "dims": [1]}), ["warmup.0.inputs.X.datatype", "'FLOAT'"]),
    (_warm(NOPE={"datatype": "FP32", "dims": [1]}), ["warmup[0] ('w')", "'NOPE' is not an input", "['X'] missing"]),
    (_warm(batch_size=100), ["warmup[0] ('w')", "batch_size 100 exceeds max_batch_size 8"]),
    (_warm(X={"datatype": "INT32", "dims": [1]}), ["warmup[0] ('w')", "'INT32'", "expects 'FP32'"]),
    (_warm(X={"datatype": "FP32", "dims": [-5]}), ["warmup.0.inputs.X.dims", "[-5]"]),
    (_warm(X={"datatype": "FP32", "dims": [0]}), ["warmup.0.inputs.X.dims", "[0]"]),
    (_warm(X={"datatype": "FP32", "dims": [99999999999]}), ["warmup.0", "99999999999", str(MAX_WARMUP_ELEMENTS)]),
    (_warm(batch_size=8, X={"datatype": "FP32", "dims": [MAX_WARMUP_ELEMENTS // 4]}), ["warmup.0", "batch_size 8"]),
    (_warm(X={"datatype": "FP32", "dims": [1, 2]}), ["warmup[0] ('w')", "dims [1, 2] do not fit"]),
])
def test_invalid_warmups_are_rejected(warmup, fragments):
    with pytest.raises(ConfigError) as info:
        parse_config(_base(max_batch_size=8, warmup=warmup), name="m")
    for fragment in fragments:
        assert fragment in info.value.message


def test_warmup_batch_size_needs_a_batching_model():
    with pytest.raises(ConfigError, match="batch_size 2 needs max_batch_size >= 1"):
        parse_config(_base(warmup=_warm(batch_size=2)), name="m")


def test_valid_warmups_are_accepted():
    optional = [{"name": "X", "datatype": "FP32", "dims": [-1, 3]},
                {"name": "MASK", "datatype": "BOOL", "dims": [1], "optional": True}]
    config = parse_config(_base(max_batch_size=8, inputs=optional,
                                warmup=_warm(batch_size=8, X={"datatype": "FP32", "dims": [5, 3]})), name="m")
    assert config.warmup[0].inputs["X"].dims == (5, 3)
    # Inputs left to the artifact: only the shape itself can be checked now (again at load).
    config = parse_config({"backend": "onnxruntime", "warmup": _warm(Z={"datatype": "FP32", "dims": [4]})}, name="m")
    assert "Z" in config.warmup[0].inputs


def test_random_warmup_data_of_integer_and_bool_inputs_is_not_all_zeros():
    # Uniform [0, 1) cast to an integer type was all zeros.
    from kiln.serving.repository.version import _warm

    class Recorder:
        def execute(self, requests):
            self.inputs = requests[0].inputs
            return [{"Y": requests[0].inputs["I"]}]

    config = parse_config({
        "backend": "python", "max_batch_size": 4,
        "inputs": [{"name": "I", "datatype": "INT64", "dims": [64]}, {"name": "B", "datatype": "BOOL", "dims": [64]}],
        "outputs": [{"name": "Y", "datatype": "INT64", "dims": [64]}],
        "warmup": [{"batch_size": 4, "inputs": {"I": {"datatype": "INT64", "dims": [64], "data": "random"},
                                                "B": {"datatype": "BOOL", "dims": [64], "data": "random"}}}],
    }, name="m")
    model = Recorder()
    _warm(config, [model], config.warmup[0])
    assert set(model.inputs["I"].ravel().tolist()) == {0, 1}
    assert set(model.inputs["B"].ravel().tolist()) == {False, True}
