import asyncio
import textwrap
import time

import numpy as np
import pytest

from kiln.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError, ModelUnavailableError
from kiln.frontends.kserve import documents
from kiln.serving.types import InferRequest
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import DOUBLER_PY, add_sub_onnx, doubler_config, write_model

SLOW_LOAD_PY = textwrap.dedent('''
    import time
    class Slow:
        def load(self, context):
            time.sleep(float(context.config.parameters.get("load_s", 0.5)))
        def execute(self, requests):
            return [{"OUT": r.inputs["IN"]} for r in requests]
''')


def run(coro):
    return asyncio.run(coro)


def doubler_request(value=1.0, version=""):
    return InferRequest("doubler", {"IN": np.full((1, 2), value, np.float32)}, model_version=version)


def test_bad_models_do_not_stop_the_others(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "bad_yaml", {"backend": "python", "surprise": True}, {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "bad_load", doubler_config(parameters={"fail_load": True}), {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "bad_onnx", {"backend": "onnxruntime"}, {1: {"model.onnx": b"not an onnx file"}})
    write_model(tmp_path, "no_versions", doubler_config())

    async def main():
        plane = repository_plane(tmp_path)
        errors = await plane.start()
        response = await plane.infer(doubler_request(2.0))
        index = {row["name"]: row for row in plane.repository_index()}
        ready = plane.ready()
        with pytest.raises(ModelUnavailableError, match="bad_load"):
            await plane.infer(InferRequest("bad_load", {}))
        await plane.shutdown()
        return errors, response, index, ready
    errors, response, index, ready = run(main())
    assert set(errors) == {"bad_yaml", "bad_load", "bad_onnx", "no_versions"}
    assert "surprise" in errors["bad_yaml"] and "asked to fail" in errors["bad_load"]
    assert response.outputs["OUT"].tolist() == [[4.0, 4.0]]
    assert index["doubler"]["state"] == "READY" and index["bad_onnx"]["state"] == "UNAVAILABLE"
    assert "onnxruntime could not load" in index["bad_onnx"]["reason"]
    assert not ready  # strict readiness


def test_failed_reload_keeps_the_old_version_serving(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        (tmp_path / "doubler" / "2").mkdir()
        (tmp_path / "doubler" / "2" / "model.py").write_text("this is not python")
        with pytest.raises(ModelLoadError, match="failed to load 'doubler'"):
            await plane.load_model("doubler")
        still = await plane.infer(doubler_request(1.0))
        (tmp_path / "doubler" / "2" / "model.py").write_text(DOUBLER_PY)
        await plane.load_model("doubler")
        new = await plane.infer(doubler_request(1.0))
        with pytest.raises(ModelNotFoundError, match="version 1 is not found"):
            await plane.infer(doubler_request(1.0, version="1"))
        await plane.shutdown()
        return still, new
    still, new = run(main())
    assert still.model_version == "1" and still.outputs["OUT"].tolist() == [[2.0, 2.0]]
    assert new.model_version == "2" and new.outputs["OUT"].tolist() == [[1002.0, 1002.0]]


def test_unload_waits_for_in_flight_requests(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(parameters={"delay_ms": 300}), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        inflight = asyncio.ensure_future(plane.infer(doubler_request(3.0)))
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        await plane.unload_model("doubler")
        waited = time.perf_counter() - start
        result = inflight.result() if inflight.done() else None
        with pytest.raises(ModelUnavailableError, match="unloaded"):
            await plane.infer(doubler_request())
        assert not plane.model_ready("doubler")
        await plane.load_model("doubler")
        assert plane.model_ready("doubler")
        await plane.shutdown()
        return waited, result
    waited, result = run(main())
    assert waited > 0.15
    assert result is not None and result.outputs["OUT"].tolist() == [[6.0, 6.0]]


def test_other_models_serve_while_one_loads(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "slow", doubler_config(parameters={"load_s": 0.6}), {1: {"model.py": SLOW_LOAD_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.models.load("doubler")
        plane.started = True
        loading = asyncio.ensure_future(plane.load_model("slow"))
        await asyncio.sleep(0.1)
        state = {r["name"]: r.get("state") for r in plane.repository_index()}["slow"]
        with pytest.raises(ModelUnavailableError, match="still loading"):
            await plane.infer(InferRequest("slow", {"IN": np.ones((1, 1), np.float32)}))
        start = time.perf_counter()
        served = await plane.infer(doubler_request())
        fast = time.perf_counter() - start
        await loading
        await plane.shutdown()
        return state, served, fast
    state, served, fast = run(main())
    assert state == "LOADING" and served.outputs["OUT"].tolist() == [[2.0, 2.0]] and fast < 0.3


def test_load_with_config_override_and_parameter_checks(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        override = '{"backend": "python", "max_batch_size": 2, "inputs": [{"name": "IN", "datatype": "FP32", ' \
                   '"dims": [-1]}], "outputs": [{"name": "OUT", "datatype": "FP32", "dims": [-1]}]}'
        await plane.load_model("doubler", {"config": override})
        assert plane.model_config("doubler").max_batch_size == 2
        with pytest.raises(InvalidRequestError, match="not supported"):
            await plane.load_model("doubler", {"file:1/model.py": "aW1wb3J0IG9z"})
        with pytest.raises(InvalidRequestError, match="unknown load parameter"):
            await plane.load_model("doubler", {"bogus": 1})
        with pytest.raises(ModelLoadError, match="surprise"):
            await plane.load_model("doubler", {"config": '{"backend": "python", "surprise": 1}'})
        with pytest.raises(Exception, match="invalid model name"):
            await plane.load_model("../etc", {})
        with pytest.raises(ModelNotFoundError):
            await plane.load_model("absent", {})
        await plane.shutdown()
    run(main())


def test_metadata_config_and_stats(tmp_path):
    write_model(tmp_path, "add_sub", {"backend": "onnxruntime", "max_batch_size": 4},
                {1: {"model.onnx": add_sub_onnx()}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        a = np.ones((1, 4), np.float32)
        await plane.infer(InferRequest("add_sub", {"INPUT0": a, "INPUT1": a}))
        with pytest.raises(InvalidRequestError):
            await plane.infer(InferRequest("add_sub", {"INPUT0": a}))
        config = plane.model_config("add_sub")
        result = (
            documents.model_metadata(config, plane.model_versions("add_sub")),
            documents.triton_config(config),
            documents.statistics(plane.model_statistics("add_sub")),
        )
        await plane.shutdown()
        return result
    metadata, config, stats = run(main())
    assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
    assert metadata["platform"] == "onnxruntime_onnx"
    assert config["input"][0]["data_type"] == "TYPE_FP32" and config["max_batch_size"] == 4
    model = stats["model_stats"][0]
    assert model["inference_stats"]["success"]["count"] == 1 and model["inference_stats"]["fail"]["count"] == 1
    assert model["execution_count"] == 1


def test_warmup_runs_at_load_and_bad_warmup_fails_the_load(tmp_path):
    warm = [{"name": "w", "batch_size": 2, "count": 2, "inputs": {"IN": {"datatype": "FP32", "dims": [3]}}}]
    write_model(tmp_path, "doubler", doubler_config(warmup=warm), {1: {"model.py": DOUBLER_PY}})
    bad = [{"inputs": {"IN": {"datatype": "INT32", "dims": [3]}}}]
    write_model(tmp_path, "bad_warm", doubler_config(warmup=bad), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        errors = await plane.start()
        await plane.shutdown()
        return errors
    errors = run(main())
    assert list(errors) == ["bad_warm"] and "data-type is 'INT32'" in errors["bad_warm"]
