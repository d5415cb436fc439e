import asyncio

import pytest

from kiln.cli.main import main as kiln_main
from kiln.errors import ModelConfigLoadError
from kiln.serving.repository.validate import validate_repository
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import DOUBLER_PY, add_sub_onnx, basic_repository, doubler_config, write_model


async def load_from(repository, name):
    """Load one model of `repository` as the model-control API does (its error, if any, raised)."""
    plane = repository_plane(repository, model_control="explicit")
    try:
        await plane.load_model(name)
    finally:
        await plane.shutdown()


def test_valid_repository_has_no_problems(tmp_path, capsys):
    basic_repository(tmp_path)
    assert validate_repository(tmp_path) == []
    assert kiln_main(["repo", "validate", str(tmp_path)]) == 0
    assert "all models valid" in capsys.readouterr().out


def test_each_bad_model_is_reported(tmp_path, capsys):
    basic_repository(tmp_path)
    write_model(tmp_path, "typo", doubler_config(max_batch_sise=3), {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "no_artifact", doubler_config(), {1: {"other.py": DOUBLER_PY}})
    write_model(tmp_path, "no_version", {"backend": "onnxruntime"})
    write_model(tmp_path, "bad_graph", {
        "backend": "ensemble", "inputs": [{"name": "A", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "S", "datatype": "FP32", "dims": [4]}],
        "steps": [{"model": "add_sub", "input_map": {"INPUT0": "A", "INPUT1": "missing"},
                   "output_map": {"OUTPUT0": "S"}}],
    })
    write_model(tmp_path, "auto_onnx", {"backend": "onnxruntime", "max_batch_size": 2},
                {1: {"model.onnx": add_sub_onnx()}})
    write_model(tmp_path, "twice", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    (tmp_path / "twice" / "config.yaml").write_text("backend: python\nmax_batch_size: 4\nmax_batch_size: 0\n")
    problems = validate_repository(tmp_path)
    text = "\n".join(problems)
    assert len(problems) == 5, text
    assert "twice: config.yaml of model 'twice' is not valid YAML: line 3, column 1: found the key " \
           "'max_batch_size' twice (first on line 2)" in text
    assert "typo:" in text and "max_batch_sise" in text
    assert "no_artifact: version 1: missing artifact model.py" in text
    assert "no_version:" in text and "bad_graph:" in text and "'missing'" in text
    assert kiln_main(["repo", "validate", str(tmp_path)]) == 1
    assert validate_repository(tmp_path / "absent")[0].endswith("is not a directory")


def test_bad_warmups_fail_validation_and_load_with_a_config_error(tmp_path, capsys):
    warm = [{"name": "w", "inputs": {"IN": {"datatype": "FP32", "dims": [-5]}}}]
    write_model(tmp_path, "doubler", doubler_config(warmup=warm), {1: {"model.py": DOUBLER_PY}})
    # An ONNX model's inputs are only known from the file: its warm-up is checked once they are.
    onnx_warm = [{"name": "w", "inputs": {"NOPE": {"datatype": "FP32", "dims": [4]}}}]
    write_model(tmp_path, "auto_onnx", {"backend": "onnxruntime", "max_batch_size": 2, "warmup": onnx_warm},
                {1: {"model.onnx": add_sub_onnx()}})
    text = "\n".join(validate_repository(tmp_path))
    assert "doubler: invalid config" in text and "dims [-5]" in text
    assert "auto_onnx: invalid config" in text and "'NOPE' is not an input" in text
    assert kiln_main(["repo", "validate", str(tmp_path)]) == 1

    for name, fragment in (("doubler", "dims [-5]"), ("auto_onnx", "'NOPE' is not an input")):
        with pytest.raises(ModelConfigLoadError) as info:  # a 400, not a 500 from numpy
            asyncio.run(load_from(tmp_path, name))
        assert info.value.http_status == 400 and fragment in info.value.message


def test_validate_agrees_with_load_on_what_a_model_may_say(tmp_path):
    # Embedding settings of an llm model loaded but failed validation; a bad ONNX thread count
    # was a traceback (a 500 at load); a step's missing version passed validation, then the
    # load said "unknown model"; directories '1' and '01' both became version 1.
    basic_repository(tmp_path)
    write_model(tmp_path, "emb", {"backend": "llm", "parameters": {"pooling": "mean", "embedding_only": True}}, {1: {}})
    write_model(tmp_path, "threads", {"backend": "onnxruntime", "max_batch_size": 2,
                                      "parameters": {"intra_op_num_threads": "abc"}},
                {1: {"model.onnx": add_sub_onnx()}})
    write_model(tmp_path, "pinned", {
        "backend": "ensemble", "inputs": [{"name": "A", "datatype": "FP32", "dims": [4]},
                                          {"name": "B", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "S", "datatype": "FP32", "dims": [4]}],
        "steps": [{"model": "add_sub", "version": 7, "input_map": {"INPUT0": "A", "INPUT1": "B"},
                   "output_map": {"OUTPUT0": "S"}}],
    })
    write_model(tmp_path, "twice", doubler_config(), {1: {"model.py": DOUBLER_PY}, "01": {"model.py": DOUBLER_PY}})
    problems = sorted(validate_repository(tmp_path))
    assert problems == [
        "pinned: ensemble 'pinned': step 0 uses version 7 of 'add_sub', which it does not have (or has not loaded)",
        "threads: parameters.intra_op_num_threads must be an integer >= 0, got 'abc'",
        "twice: version directories '01' and '1' of 'twice' are both version 1",
    ]

    with pytest.raises(ModelConfigLoadError, match="step 0 uses version 7 of 'add_sub'"):
        asyncio.run(load_from(tmp_path, "pinned"))


def test_an_onnx_model_declaring_one_side_is_read_as_the_load_reads_it(tmp_path):
    # Validate filled both sides from the graph when a config declared only its outputs; the load
    # keeps the declared side, so an ensemble using an undeclared output passed validation only.
    write_model(tmp_path, "add_sub", {"backend": "onnxruntime", "max_batch_size": 2,
                                      "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "dims": [4]}]},
                {1: {"model.onnx": add_sub_onnx()}})
    write_model(tmp_path, "diff", {
        "backend": "ensemble", "max_batch_size": 2,
        "inputs": [{"name": "A", "datatype": "FP32", "dims": [4]}, {"name": "B", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "D", "datatype": "FP32", "dims": [4]}],
        "steps": [{"model": "add_sub", "input_map": {"INPUT0": "A", "INPUT1": "B"}, "output_map": {"OUTPUT1": "D"}}],
    })
    assert validate_repository(tmp_path) == ["diff: ensemble 'diff': step 0 (add_sub) has no output 'OUTPUT1'"]
