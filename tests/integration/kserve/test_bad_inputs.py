"""Bad input matrix for both transports: right status, clear message, and
the server still serving afterwards."""
import json

import grpc
import numpy as np
import pytest

from tests.integration.kserve.conftest import MAX_BODY

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")

ONES = [1.0, 1.0, 1.0, 1.0]


def tensor(name="INPUT0", datatype="FP32", shape=(1, 4), data=ONES):
    return {"name": name, "datatype": datatype, "shape": list(shape), "data": data}


def body(*inputs, **extra):
    return json.dumps({"inputs": list(inputs), **extra}).encode()


GOOD = (tensor("INPUT0"), tensor("INPUT1"))

HTTP_CASES = {
    "wrong shape": ("add_sub", body(tensor("INPUT0", shape=(1, 5), data=ONES + [1.0]), GOOD[1]), {}, 400,
                    "unexpected shape for input 'INPUT0' for model 'add_sub'. Expected [-1, 4], got [1, 5]"),
    "wrong datatype": ("add_sub", body(tensor("INPUT0", "INT64", data=[1, 1, 1, 1]), GOOD[1]), {}, 400,
                       "inference input 'INPUT0' data-type is 'INT64', but model 'add_sub' expects 'FP32'"),
    "byte size": ("add_sub", None, {}, 400, "input byte size mismatch for input 'INPUT0'. Expected 16, got 12"),
    "data count": ("add_sub", body(tensor(data=[1.0, 2.0]), GOOD[1]), {}, 400, "needs 4, got 2"),
    "missing input": ("add_sub", body(GOOD[0]), {}, 400,
                      "missing required input(s) ['INPUT1']"),
    "unknown input": ("add_sub", body(*GOOD, tensor("EXTRA")), {}, 400,
                      "unexpected inference input 'EXTRA' for model 'add_sub'"),
    "unknown model": ("nope", body(*GOOD), {}, 404, "Request for unknown model: 'nope' is not found"),
    "batch too big": ("add_sub", body(tensor(shape=(9, 4), data=ONES * 9),
                                      tensor("INPUT1", shape=(9, 4), data=ONES * 9)),
                      {}, 400, "batch-size must be <= 8"),
    "empty batch": ("add_sub", body(tensor(shape=(0, 4), data=[]), tensor("INPUT1", shape=(0, 4), data=[])),
                    {}, 400, "batch-size must be at least 1 for 'add_sub', got 0"),
    "negative dim": ("add_sub", body(tensor(shape=(2, -5)), GOOD[1]), {}, 400, "negative dimension"),
    "element overflow": ("add_sub", body(tensor(shape=(16, 2 ** 60 + 2)), GOOD[1]), {}, 400, "exceed maximum size"),
    "malformed json": ("add_sub", b'{"inputs": [', {}, 400, "failed to parse the request JSON"),
    "not an object": ("add_sub", b"[1, 2]", {}, 400, "must be a JSON object"),
    "null body": ("add_sub", b"null", {}, 400, "must be a JSON object"),
    "too deep": ("add_sub", b'{"inputs": [], "parameters": {"a": ' + b"[" * 120 + b"]" * 120 + b"}}", {}, 400,
                 "JSON nesting depth exceeds maximum allowed limit (100)"),
    "duplicate outputs": ("add_sub", body(*GOOD, outputs=[{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]), {}, 400,
                          "output 'OUTPUT0' already exists in request"),
    "unknown output": ("add_sub", body(*GOOD, outputs=[{"name": "NOPE"}]), {}, 400,
                       "unexpected inference output 'NOPE'"),
    "header length": ("add_sub", body(*GOOD), {"Inference-Header-Content-Length": "99999999999"}, 400, "out of range"),
    "bad header": ("add_sub", body(*GOOD), {"Inference-Header-Content-Length": "-3"}, 400, "invalid"),
    "oversized": ("add_sub", b" " * (MAX_BODY + 1), {}, 400, "exceeds the maximum allowed input size"),
}


def _byte_size_body():
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 12}},
        tensor("INPUT1")]}).encode()
    return header + b"\0" * 12, {"Inference-Header-Content-Length": str(len(header))}


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_http_bad_input(server, case):
    model, content, headers, status, message = HTTP_CASES[case]
    if content is None:
        content, headers = _byte_size_body()
    response = server.post(f"/v2/models/{model}/infer", content=content, headers=headers)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert server.alive()


def test_http_unknown_version_and_model_paths(server):
    response = server.post("/v2/models/add_sub/versions/9/infer", content=body(*GOOD))
    assert response.status_code == 404 and "version 9 is not found" in response.json()["error"]
    assert server.get("/v2/models/nope").status_code == 404
    assert server.get("/v2/models/add_sub/versions/x/config").status_code == 400
    assert server.post("/v2/repository/models/nope/unload").status_code == 404
    deep = b"[" * 250_000 + b"]" * 250_000
    response = server.post("/v2/repository/index", content=deep)
    assert response.status_code == 400 and "nesting depth" in response.json()["error"]
    assert server.alive()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def grpc_request(model="add_sub", inputs=(("INPUT0", "FP32", (1, 4)), ("INPUT1", "FP32", (1, 4))), raw=None, **kw):
    request = service_pb2.ModelInferRequest(model_name=model, **kw)
    for name, datatype, shape in inputs:
        t = request.inputs.add(name=name, datatype=datatype)
        t.shape.extend(shape)
    if raw is None:
        raw = [np.ones(shape, np.float32).tobytes() for _, _, shape in inputs]
    request.raw_input_contents.extend(raw)
    return request


def _contents_request():
    request = service_pb2.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        t = request.inputs.add(name=name, datatype="FP32")
        t.shape.extend([1, 4])
        t.contents.fp32_contents.extend(ONES)
    return request


def _fp16_contents_request():
    request = _contents_request()
    request.inputs[0].datatype = "FP16"
    return request


GRPC_CASES = {
    "wrong shape": (grpc_request(inputs=(("INPUT0", "FP32", (1, 5)), ("INPUT1", "FP32", (1, 4)))),
                    "INVALID_ARGUMENT", "unexpected shape for input 'INPUT0'"),
    "wrong datatype": (grpc_request(inputs=(("INPUT0", "INT32", (1, 4)), ("INPUT1", "FP32", (1, 4)))),
                       "INVALID_ARGUMENT", "data-type is 'INT32'"),
    "byte size": (grpc_request(raw=[b"\0" * 12, b"\0" * 16]), "INVALID_ARGUMENT", "Expected 16, got 12"),
    "missing input": (grpc_request(inputs=(("INPUT0", "FP32", (1, 4)),)), "INVALID_ARGUMENT",
                      "missing required input(s) ['INPUT1']"),
    "raw count": (grpc_request(raw=[b"\0" * 16]), "INVALID_ARGUMENT", "raw_input_contents has 1 entries"),
    "fp16 contents": (_fp16_contents_request(), "INVALID_ARGUMENT", "must be sent in raw_input_contents"),
    "unknown model": (grpc_request(model="nope"), "NOT_FOUND", "Request for unknown model: 'nope' is not found"),
    "unknown version": (grpc_request(model_version="3"), "NOT_FOUND", "version 3 is not found"),
    "negative dim": (grpc_request(inputs=(("INPUT0", "FP32", (2, -5)), ("INPUT1", "FP32", (1, 4))),
                                  raw=[b"", b"\0" * 16]), "INVALID_ARGUMENT", "negative dimension"),
    "oversized": (grpc_request(raw=[b"\0" * (MAX_BODY + 10), b""]), "RESOURCE_EXHAUSTED", ""),
}


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_bad_input(server, stub, case):
    request, code, message = GRPC_CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == getattr(grpc.StatusCode, code)
    assert message in info.value.details()
    assert stub.ServerLive(service_pb2.ServerLiveRequest()).live


def test_grpc_typed_contents_work(stub):
    response = stub.ModelInfer(_contents_request(), timeout=30)
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [2.0] * 4
