"""The stock tritonclient.http against a live Kiln server."""
import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.integration.kserve.conftest import MAX_BODY  # noqa: E402


@pytest.fixture(scope="module")
def client(server):
    return httpclient.InferenceServerClient(server.http_url, concurrency=16)


def _inputs(a, b, binary=True):
    i0 = httpclient.InferInput("INPUT0", list(a.shape), "FP32")
    i0.set_data_from_numpy(a, binary_data=binary)
    i1 = httpclient.InferInput("INPUT1", list(b.shape), "FP32")
    i1.set_data_from_numpy(b, binary_data=binary)
    return [i0, i1]


def test_health_and_server_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "kiln" and "binary_data" in meta["extensions"]


def test_model_metadata_config_and_readiness(client):
    meta = client.get_model_metadata("add_sub")
    assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
    assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
    assert client.get_model_metadata("add_sub", "1")["name"] == "add_sub"
    config = client.get_model_config("pipeline")
    assert config["ensemble_scheduling"]["step"][0]["model_name"] == "add_sub"
    assert client.is_model_ready("add_sub") and client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "7") and not client.is_model_ready("nope")


@pytest.mark.parametrize("binary", [True, False])
def test_infer_json_and_binary(client, binary):
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), np.float32)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    result = client.infer("add_sub", _inputs(a, b, binary), outputs=outputs, request_id="req-7")
    assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_version"] == "1"


def test_infer_without_requested_outputs_and_compression(client):
    a = np.ones((1, 4), np.float32)
    result = client.infer("add_sub", _inputs(a, a), request_compression_algorithm="gzip")
    assert np.array_equal(result.as_numpy("OUTPUT0"), a * 2)
    result = client.infer("pipeline", [_named("A", a), _named("B", a)], outputs=None)
    assert np.array_equal(result.as_numpy("DOUBLED_SUM"), a * 4)


def _named(name, array, datatype="FP32", binary=True):
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_tensors(client, binary):
    text = np.array([b"hello", "w\u00f6rld".encode(), b""], dtype=object)
    result = client.infer("upper", [_named("TEXT", text, "BYTES", binary)],
                          outputs=[httpclient.InferRequestedOutput("UPPER", binary_data=binary),
                                   httpclient.InferRequestedOutput("LEN", binary_data=binary)])
    upper = result.as_numpy("UPPER")
    assert [x if isinstance(x, bytes) else x.encode() for x in upper] == [b"HELLO", "W\u00f6RLD".encode(), b""]
    assert result.as_numpy("LEN").tolist() == [5, 6, 0]


def test_repository_index_load_and_unload(client):
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["doubler"]["state"] == "READY"
    client.unload_model("upper")
    assert not client.is_model_ready("upper")
    with pytest.raises(InferenceServerException, match="unloaded"):
        client.infer("upper", [_named("TEXT", np.array([b"x"], dtype=object), "BYTES")])
    client.load_model("upper")
    assert client.is_model_ready("upper")
    with pytest.raises(InferenceServerException, match="not in the model repository"):
        client.load_model("does_not_exist")
    with pytest.raises(InferenceServerException, match="invalid model name"):
        client.load_model("..%2F..%2Fetc")


def test_the_config_read_edited_and_sent_back_reloads_the_model(client):
    # Triton's round trip: get_model_config, edit, load_model(config=...) was a 400 ("Extra inputs
    # are not permitted") because the override took only Kiln's config.yaml form.
    config = client.get_model_config("doubler")
    config["max_batch_size"] = 4
    client.load_model("doubler", config=json.dumps(config))
    try:
        assert client.get_model_config("doubler")["max_batch_size"] == 4
        x = np.ones((4, 3), np.float32)
        assert client.infer("doubler", [_named("IN", x)]).as_numpy("OUT").tolist() == (x * 2).tolist()
        with pytest.raises(InferenceServerException, match="exceeds max_batch_size|must be <= 4"):
            client.infer("doubler", [_named("IN", np.ones((5, 3), np.float32))])
        config["sequence_batching"] = {}
        with pytest.raises(InferenceServerException, match=r"\['sequence_batching'\] are not supported by Kiln"):
            client.load_model("doubler", config=json.dumps(config))
    finally:
        client.load_model("doubler")  # its config.yaml again


def test_statistics(client):
    client.infer("add_sub", _inputs(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)))
    stats = client.get_inference_statistics("add_sub")["model_stats"][0]
    assert stats["name"] == "add_sub" and stats["inference_stats"]["success"]["count"] >= 1
    assert stats["execution_count"] >= 1
    everything = client.get_inference_statistics()["model_stats"]
    assert {"add_sub", "doubler"} <= {s["name"] for s in everything}


def test_dynamic_batching_through_the_server(client):
    before = client.get_inference_statistics("doubler")["model_stats"][0]
    inputs = [np.full((1, 5), i, np.float32) for i in range(12)]
    handles = [client.async_infer("doubler", [_named("IN", x)]) for x in inputs]
    results = [h.get_result().as_numpy("OUT") for h in handles]
    after = client.get_inference_statistics("doubler")["model_stats"][0]
    unbatched = [client.infer("doubler", [_named("IN", x)]).as_numpy("OUT") for x in inputs[:2]]
    for x, out in zip(inputs, results, strict=True):
        assert np.array_equal(out, x * 2)
    assert np.array_equal(unbatched[1], results[1])
    executions = after["execution_count"] - before["execution_count"]
    assert after["inference_count"] - before["inference_count"] == 12
    assert executions < 12, f"12 concurrent requests ran in {executions} batches"


def _infer_slow(server, **kw):
    # One client per thread: the http client's connection pool is not thread-safe.
    client = httpclient.InferenceServerClient(server.http_url)
    return client.infer("slow", [_named("IN", np.ones((1, 2), np.float32))], **kw)


def test_queue_full_and_timeout(server):
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(_infer_slow, server)
        time.sleep(0.15)
        queued = pool.submit(_infer_slow, server)
        time.sleep(0.15)
        with pytest.raises(InferenceServerException) as info:
            _infer_slow(server)
        assert info.value.status() == "503" and "Exceeds maximum queue size" in info.value.message()
        running.result(), queued.result()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(_infer_slow, server)
        time.sleep(0.15)
        with pytest.raises(InferenceServerException) as info:
            _infer_slow(server, timeout=50_000)
        assert info.value.status() == "503" and "Request timeout expired" in info.value.message()
        running.result()
    assert server.alive()


def test_oversized_body_is_refused_and_server_keeps_serving(client, server):
    big = np.zeros((1, MAX_BODY // 4 + 16), np.float32)
    response = server.post("/v2/models/doubler/infer", content=_raw_body("IN", big),
                           headers={"Inference-Header-Content-Length": str(_header_len("IN", big))})
    assert response.status_code == 400 and "exceeds the maximum allowed input size" in response.json()["error"]
    bomb = gzip.compress(b"\0" * (MAX_BODY * 2))
    response = server.post("/v2/models/doubler/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 400 and "after decompression" in response.json()["error"]
    assert server.alive() and client.is_model_ready("doubler")


def _header(name, array):
    import json
    return json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(array.shape),
                                   "parameters": {"binary_data_size": array.nbytes}}]}).encode()


def _header_len(name, array):
    return len(_header(name, array))


def _raw_body(name, array):
    return _header(name, array) + array.tobytes()


def test_client_disconnect_cancels_the_request(server):
    import httpx

    def canceled():
        text = server.get("/metrics").text
        line = [x for x in text.splitlines()
                if x.startswith('kiln_inference_request_failure_total{model="slow"') and 'reason="CANCELED"' in x]
        return float(line[0].split()[-1]) if line else 0.0

    before = canceled()
    body = b'{"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}'
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_infer_slow, server)  # occupies the one instance
        time.sleep(0.1)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"http://{server.http_url}/v2/models/slow/infer", content=body, timeout=0.1)
        running.result()
    deadline = time.monotonic() + 5
    while canceled() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert canceled() == before + 1
    assert server.alive()
