"""InferFastPath: infer paths reach the KServe handler, everything else the app."""
import numpy as np
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kiln.errors import ModelNotFoundError
from kiln.frontends.kserve.fast_path import InferFastPath
from kiln.serving.codecs.limits import Limits
from kiln.serving.types import InferResponse


class FakeDataPlane:
    limits = Limits()

    def __init__(self):
        self.seen = []

    async def infer(self, request, route_key=None):
        self.seen.append((request.model_name, request.model_version, route_key))
        if request.model_name == "missing":
            raise ModelNotFoundError("Request for unknown model: 'missing' is not found")
        return InferResponse(request.model_name, request.model_version or "1", {"OUT": request.inputs["IN"] * 2})


def client() -> tuple[TestClient, FakeDataPlane]:
    async def rest(request):
        return PlainTextResponse(f"app {request.method} {request.url.path}")

    app = Starlette(routes=[Route("/{path:path}", rest, methods=["GET", "POST"])])
    dataplane = FakeDataPlane()
    return TestClient(InferFastPath(app, dataplane)), dataplane


BODY = {"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2]}]}


def test_infer_paths_are_answered_by_the_kserve_handler():
    http, dataplane = client()
    plain = http.post("/v2/models/m/infer", json=BODY, headers={"x-kiln-route-key": "k"})
    versioned = http.post("/v2/models/m/versions/3/infer", json=BODY)
    assert plain.status_code == versioned.status_code == 200
    assert plain.json()["outputs"] == [{"name": "OUT", "datatype": "FP32", "shape": [1, 2], "data": [3.0, 4.0]}]
    assert dataplane.seen == [("m", "", "k"), ("m", "3", None)]
    assert np.isclose(versioned.json()["outputs"][0]["data"], [3.0, 4.0]).all()


def test_errors_keep_the_kserve_error_body():
    http, _ = client()
    missing = http.post("/v2/models/missing/infer", json=BODY)
    assert missing.status_code == 404 and "missing" in missing.json()["error"]
    bad = http.post("/v2/models/m/infer", json={"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32"}]})
    assert bad.status_code == 400 and "'IN'" in bad.json()["error"]


def test_other_paths_and_methods_reach_the_app():
    http, dataplane = client()
    assert http.get("/v2/models/m/infer").text == "app GET /v2/models/m/infer"
    assert http.post("/v2/models/m/infer/").text == "app POST /v2/models/m/infer/"
    assert http.post("/v2/models/m/versions/infer").text == "app POST /v2/models/m/versions/infer"
    assert http.post("/v1/completions").text == "app POST /v1/completions"
    assert dataplane.seen == []
