import asyncio

import numpy as np
import pytest

from kiln.errors import ConfigError, ModelLoadError
from kiln.serving.ensemble.dag import validate_ensemble
from kiln.serving.repository.config import parse_config
from kiln.serving.types import InferRequest
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import basic_repository, doubler_config, write_model

T = {"datatype": "FP32", "dims": [-1]}
MEMBERS = {
    "a": parse_config({"backend": "python", "inputs": [{"name": "X", **T}], "outputs": [{"name": "Y", **T}]}, name="a"),
    "b": parse_config({"backend": "python", "inputs": [{"name": "X", **T}, {"name": "Z", **T, "optional": True}],
                       "outputs": [{"name": "Y", **T}]}, name="b"),
    "i": parse_config({"backend": "python", "inputs": [{"name": "X", "datatype": "INT32", "dims": [-1]}],
                       "outputs": [{"name": "Y", **T}]}, name="i"),
}


def ensemble(steps, outputs=("OUT",)):
    return parse_config({"backend": "ensemble", "inputs": [{"name": "IN", **T}],
                         "outputs": [{"name": o, **T} for o in outputs], "steps": steps}, name="e")


def step(model, inp, out, in_name="X", out_name="Y"):
    return {"model": model, "input_map": {in_name: inp}, "output_map": {out_name: out}}


def test_valid_chain_and_dependencies():
    config = ensemble([step("a", "IN", "t"), step("b", "t", "OUT")])
    assert validate_ensemble(config, lambda name, version: MEMBERS.get(name)) == [[], [0]]


@pytest.mark.parametrize("steps, outputs, fragment", [
    ([step("zzz", "IN", "OUT")], ("OUT",), "unknown model 'zzz'"),
    ([step("a", "nothing", "OUT")], ("OUT",), "needs tensor 'nothing', which nothing produces"),
    ([step("a", "t2", "t1"), step("b", "t1", "t2"), step("a", "IN", "OUT")], ("OUT",), "form a cycle"),
    ([step("i", "IN", "OUT")], ("OUT",), "type mismatch on tensor 'IN'"),
    ([step("a", "IN", "OUT"), step("b", "IN", "OUT")], ("OUT",), "produced more than once"),
    ([step("a", "IN", "t")], ("OUT",), "output 'OUT' is not produced"),
    ([step("a", "IN", "OUT", in_name="NOPE")], ("OUT",), "has no input 'NOPE'"),
    ([step("a", "IN", "OUT", out_name="NOPE")], ("OUT",), "has no output 'NOPE'"),
    ([{"model": "a", "input_map": {}, "output_map": {"Y": "OUT"}}], ("OUT",), "unmapped"),
])
def test_invalid_graphs(steps, outputs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_ensemble(ensemble(steps, outputs), lambda name, version: MEMBERS.get(name))


def test_ensemble_runs_and_member_errors_fail_the_request(tmp_path):
    basic_repository(tmp_path)

    async def main():
        plane = repository_plane(tmp_path)
        assert await plane.start() == {}
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        b = np.ones((2, 4), np.float32)
        ok = await plane.infer(InferRequest("pipeline", {"A": a, "B": b}))
        with pytest.raises(Exception, match="negative input"):  # doubler refuses negatives
            await plane.infer(InferRequest("pipeline", {"A": -a - 5, "B": b}))
        stats = plane.model_statistics("doubler")[0].as_dict()
        await plane.shutdown()
        return a, b, ok, stats
    a, b, ok, stats = asyncio.run(main())
    assert np.array_equal(ok.outputs["DOUBLED_SUM"], (a + b) * 2)
    assert np.array_equal(ok.outputs["DIFF"], a - b)
    assert stats["inference_stats"]["success"]["count"] == 1


def test_invalid_ensemble_in_repository_is_a_load_error(tmp_path):
    basic_repository(tmp_path)
    write_model(tmp_path, "broken", {
        "backend": "ensemble", "inputs": [{"name": "A", "datatype": "INT64", "dims": [4]}],
        "outputs": [{"name": "S", "datatype": "FP32", "dims": [4]}],
        "steps": [{"model": "add_sub", "input_map": {"INPUT0": "A", "INPUT1": "A"}, "output_map": {"OUTPUT0": "S"}}],
    })

    async def main():
        plane = repository_plane(tmp_path)
        errors = await plane.start()
        with pytest.raises(ModelLoadError, match="type mismatch"):
            await plane.load_model("broken")
        await plane.shutdown()
        return errors
    errors = asyncio.run(main())
    assert list(errors) == ["broken"] and "type mismatch on tensor 'A'" in errors["broken"]


def test_loading_an_ensemble_loads_its_members(tmp_path):
    basic_repository(tmp_path)

    async def main():
        plane = repository_plane(tmp_path)
        await plane.load_model("pipeline")
        ready = plane.model_ready("add_sub"), plane.model_ready("doubler"), plane.model_ready("upper")
        await plane.shutdown()
        return ready
    assert asyncio.run(main()) == (True, True, False)


INPLACE_PY = '''
class Inplace:
    def execute(self, requests):
        out = []
        for r in requests:
            x = r.inputs["IN"]
            x *= 2  # writes into the array it was given
            out.append({"OUT": x})
        return out
'''


def test_a_step_that_writes_into_its_input_changes_no_other_reader(tmp_path):
    # SUM is a response tensor and the in-place step's input; A goes to add_sub and
    # to a second in-place step. Each reader must see the values as produced.
    basic_repository(tmp_path)
    write_model(tmp_path, "inplace", doubler_config(), {1: {"model.py": INPLACE_PY}})
    four = {"datatype": "FP32", "dims": [4]}
    write_model(tmp_path, "shared", {
        "backend": "ensemble",
        "max_batch_size": 8,
        "inputs": [{"name": "A", **four}, {"name": "B", **four}],
        "outputs": [{"name": n, **four} for n in ("SUM", "TWICE_SUM", "TWICE_A")],
        "steps": [
            {"model": "add_sub", "input_map": {"INPUT0": "A", "INPUT1": "B"}, "output_map": {"OUTPUT0": "SUM"}},
            {"model": "inplace", "input_map": {"IN": "SUM"}, "output_map": {"OUT": "TWICE_SUM"}},
            {"model": "inplace", "input_map": {"IN": "A"}, "output_map": {"OUT": "TWICE_A"}},
        ],
    })

    async def main():
        plane = repository_plane(tmp_path)
        assert await plane.start() == {}
        a, b = np.array([[1, 2, 3, 4]], np.float32), np.zeros((1, 4), np.float32)
        result = await plane.infer(InferRequest("shared", {"A": a.copy(), "B": b}))
        await plane.shutdown()
        return a, result.outputs
    a, outputs = asyncio.run(main())
    assert np.array_equal(outputs["SUM"], a) and np.array_equal(outputs["TWICE_SUM"], a * 2)
    assert np.array_equal(outputs["TWICE_A"], a * 2)
