"""KServe request parameters over HTTP read as their types: "false" is false
(it was true: any non-empty string), a flag that is no boolean and a timeout
that is no non-negative number are 400s naming them (a bad timeout was dropped)."""
from __future__ import annotations

from starlette.testclient import TestClient

from kiln.server.app import build_app
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import basic_repository

ROW = {"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}


def infer(client, **body):
    return client.post("/v2/models/doubler/infer", json={"inputs": [ROW], **body})


def test_flags_and_timeouts_as_their_types(tmp_path):
    basic_repository(tmp_path)
    plane = repository_plane(tmp_path, model_control="explicit")
    with TestClient(build_app(plane)) as client:
        for name in ("add_sub", "doubler", "pipeline"):
            assert client.post(f"/v2/repository/models/{name}/load", json={}).status_code == 200
        as_json = infer(client, outputs=[{"name": "OUT", "parameters": {"binary_data": "false"}}])
        assert as_json.json()["outputs"][0]["data"] == [2.0, 4.0]
        as_binary = infer(client, outputs=[{"name": "OUT", "parameters": {"binary_data": "TRUE"}}])
        assert "Inference-Header-Content-Length" in as_binary.headers
        assert "data" in infer(client, parameters={"binary_data_output": "false"}).json()["outputs"][0]
        for body, param in ((dict(outputs=[{"name": "OUT", "parameters": {"binary_data": "no"}}]), "binary_data"),
                            (dict(parameters={"binary_data_output": 1}), "binary_data_output"),
                            (dict(parameters={"timeout": "abc"}), "timeout"),
                            (dict(parameters={"timeout": -5}), "timeout")):
            refused = infer(client, **body)
            assert refused.status_code == 400 and f"parameter '{param}'" in refused.json()["error"], refused.text
        assert infer(client, parameters={"timeout": 0}).json()["outputs"][0]["data"] == [2.0, 4.0]
        assert infer(client, parameters={"timeout": 5_000_000}).status_code == 200
        listed = client.post("/v2/repository/index", json={"ready": "false"}).json()
        assert {m["name"] for m in listed} == {"add_sub", "doubler", "pipeline", "upper"}  # upper never loaded
        assert client.post("/v2/repository/index", json={"ready": 1}).status_code == 400
        # "false": the ensemble that uses add_sub stays loaded
        unloaded = client.post("/v2/repository/models/add_sub/unload",
                               json={"parameters": {"unload_dependents": "false"}})
        assert unloaded.status_code == 200
        assert plane.model_states()["pipeline"] == "ready" and plane.model_states().get("add_sub") != "ready"
