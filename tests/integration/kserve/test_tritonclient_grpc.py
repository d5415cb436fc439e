"""The stock tritonclient.grpc against a live Kiln server."""
import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def _named(name, array, datatype="FP32"):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "kiln" and "model_repository" in meta["extensions"]
    model = client.get_model_metadata("add_sub", as_json=True)
    assert model["platform"] == "onnxruntime_onnx"
    assert model["inputs"][1] == {"name": "INPUT1", "datatype": "FP32", "shape": ["-1", "4"]}
    assert client.is_model_ready("doubler") and not client.is_model_ready("nope")


def test_model_config(client):
    config = client.get_model_config("doubler", as_json=True)["config"]
    assert config["max_batch_size"] == 8 and config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "20000"
    ensemble = client.get_model_config("pipeline").config
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["add_sub", "doubler"]


def test_infer_fp32_and_bytes(client):
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 3, np.float32)
    result = client.infer("add_sub", [_named("INPUT0", a), _named("INPUT1", b)], request_id="g1",
                          outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b) and result.as_numpy("OUTPUT0") is None
    assert result.get_response().id == "g1"
    text = np.array([b"abc", b"xy"], dtype=object)
    result = client.infer("upper", [_named("TEXT", text, "BYTES")])
    assert result.as_numpy("UPPER").tolist() == [b"ABC", b"XY"] and result.as_numpy("LEN").tolist() == [3, 2]


def test_ensemble(client):
    a = np.ones((3, 4), np.float32)
    result = client.infer("pipeline", [_named("A", a), _named("B", a * 2)])
    assert np.array_equal(result.as_numpy("DOUBLED_SUM"), a * 6)


def test_stream_infer(client):
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for i in range(4):
            client.async_stream_infer("doubler", [_named("IN", np.full((1, 2), i, np.float32))], request_id=str(i))
        client.async_stream_infer("nope", [_named("IN", np.ones((1, 2), np.float32))], request_id="bad")
        got = [responses.get(timeout=30) for _ in range(5)]
    finally:
        client.stop_stream()
    results = {r.get_response().id: r.as_numpy("OUT") for r, e in got if e is None}
    errors = [e for _, e in got if e is not None]
    assert sorted(results) == ["0", "1", "2", "3"] and results["3"].tolist() == [[6.0, 6.0]]
    assert len(errors) == 1 and "unknown model" in str(errors[0])


def test_repository_control_and_statistics(client):
    names = {m.name for m in client.get_model_repository_index().models}
    assert {"add_sub", "doubler", "upper", "pipeline"} <= names
    client.unload_model("upper")
    assert not client.is_model_ready("upper")
    with pytest.raises(InferenceServerException) as info:
        client.infer("upper", [_named("TEXT", np.array([b"x"], dtype=object), "BYTES")])
    assert "UNAVAILABLE" in str(info.value.status())
    client.load_model("upper")
    assert client.is_model_ready("upper")
    config = ('{"backend": "python", "max_batch_size": 0, '
              '"inputs": [{"name": "TEXT", "datatype": "BYTES", "dims": [-1]}], '
              '"outputs": [{"name": "UPPER", "datatype": "BYTES", "dims": [-1]}]}')
    client.load_model("upper", config=config)
    assert [o.name for o in client.get_model_metadata("upper").outputs] == ["UPPER"]
    client.load_model("upper")
    # Triton's round trip in gRPC's JSON form (int64 fields as strings): read, edit, send back.
    read = client.get_model_config("upper", as_json=True)["config"]
    read["output"] = [o for o in read["output"] if o["name"] == "UPPER"]
    client.load_model("upper", config=json.dumps(read))
    assert [o.name for o in client.get_model_metadata("upper").outputs] == ["UPPER"]
    client.load_model("upper")
    stats = client.get_inference_statistics("add_sub", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) >= 1


def test_batching_and_errors_leave_server_serving(client, server):
    def one(i):
        c = grpcclient.InferenceServerClient(server.grpc_url)
        x = np.full((1, 3), i, np.float32)
        return x, c.infer("doubler", [_named("IN", x)]).as_numpy("OUT")
    before = client.get_inference_statistics("doubler").model_stats[0].execution_count
    with ThreadPoolExecutor(8) as pool:
        pairs = list(pool.map(one, range(8)))
    after = client.get_inference_statistics("doubler").model_stats[0].execution_count
    assert all(np.array_equal(out, x * 2) for x, out in pairs)
    assert after - before < 8
    with pytest.raises(InferenceServerException) as info:
        client.infer("doubler", [_named("IN", np.full((1, 3), -1, np.float32))])
    assert "negative input" in info.value.message()
    assert client.is_server_live()


def test_client_timeout_cancels_the_call(client):
    start = time.perf_counter()
    with pytest.raises(InferenceServerException) as info:
        client.infer("slow", [_named("IN", np.ones((1, 2), np.float32))], client_timeout=0.1)
    assert "Deadline" in str(info.value.message()) or "DEADLINE" in str(info.value.status())
    assert time.perf_counter() - start < 0.4
    time.sleep(0.5)
    assert client.infer("slow", [_named("IN", np.ones((1, 2), np.float32))]).as_numpy("OUT").tolist() == [[2.0, 2.0]]
