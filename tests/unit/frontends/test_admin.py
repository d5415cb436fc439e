"""The admin API for routes, and the route headers of the HTTP transports,
through the app (TestClient runs its lifespan: the models load)."""

from __future__ import annotations

import time

import numpy as np
from starlette.testclient import TestClient

from kiln.config import ServerConfig
from kiln.dataplane.dataplane import DataPlane
from kiln.server.app import build_app
from tests.unit.dataplane.routing.models import versioned_repository

AUTH = {"Authorization": "Bearer s3cret"}
INFER = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}


def app_client(tmp_path, routes, **parameters) -> TestClient:
    repo = versioned_repository(tmp_path, routes=routes, **parameters)
    dataplane = DataPlane(ServerConfig(model_repository=str(repo), api_key="s3cret", grpc_port=-1))
    dataplane.load_routes()
    return TestClient(build_app(dataplane))


def wait_ready(client: TestClient) -> None:
    for _ in range(200):
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError(client.get("/health").json())


def test_admin_routes_list_change_and_delete(tmp_path):
    with app_client(tmp_path, {"r": {"targets": {"m@1": 3, "m@2": 1}}}) as client:
        wait_ready(client)
        assert client.get("/admin/routes").status_code == 401  # the API key guards the admin API
        listed = client.get("/admin/routes", headers=AUTH).json()["routes"]
        assert listed == [{
            "name": "r",
            "targets": [{"target": "m@1", "weight": 3.0, "share": 0.75},
                        {"target": "m@2", "weight": 1.0, "share": 0.25}],
            "shadow": [], "canary": None,
        }]
        patched = client.patch("/admin/routes/r", json={"weights": {"m@1": 0, "m@3": 1}}, headers=AUTH).json()
        assert [(t["target"], t["weight"]) for t in patched["targets"]] == [("m@1", 0.0), ("m@2", 1.0), ("m@3", 1.0)]
        versions = {client.post("/v2/models/r/infer", json=INFER, headers=AUTH).json()["outputs"][0]["data"][0]
                    for _ in range(30)}
        assert versions <= {2.0, 3.0} and len(versions) == 2
        put = client.put("/admin/routes/new", json={"targets": {"m@2": 1}, "shadow": {"m@3": 0.5}}, headers=AUTH)
        assert put.status_code == 200 and put.json()["shadow"] == [{"target": "m@3", "fraction": 0.5}]
        assert client.delete("/admin/routes/new", headers=AUTH).json() == {"deleted": "new"}
        assert client.get("/admin/routes/new", headers=AUTH).status_code == 404
        metrics = client.get("/metrics").text
        assert 'kiln:route_weight{route="r",target="m@3"} 1.0' in metrics
        assert 'kiln:route_weight_changes_total{route="r",source="admin"} 1.0' in metrics


def test_admin_refuses_bad_changes_with_the_reason(tmp_path):
    with app_client(tmp_path, {"r": {"targets": {"m@1": 1}}}) as client:
        wait_ready(client)
        cases = [
            (client.put, "/admin/routes/m", {"targets": {"m@1": 1}}, 400, "has the name of a model"),
            (client.put, "/admin/routes/x", {"targets": {"nope": 1}}, 400, "names no served model"),
            (client.put, "/admin/routes/x", {"targets": {"m@9": 1}}, 400, "not 9"),
            (client.put, "/admin/routes/x", {"targets": {"m@1": 1}, "extra": 1}, 400, "extra"),
            (client.patch, "/admin/routes/r", {"weights": {"m@1": 0}}, 400, "positive weight"),
            (client.patch, "/admin/routes/r", {"weights": {"zzz": 1}}, 400, "target 'zzz' names no served model"),
            (client.patch, "/admin/routes/r", {"weights": {"m@9": 0}}, 400, "not 9"),
            (client.patch, "/admin/routes/nope", {"weights": {"m@1": 1}}, 404, "does not exist"),
        ]
        for path, text in (("/admin/routes/r", '{"weights": {"m@1": 1, "m@1": 0}}'),  # the last won in silence
                           ("/admin/routes/x", '{"targets": {"m@1": 1}, "targets": {"m@2": 1}}')):
            method = client.patch if "weights" in text else client.put
            r = method(path, content=text, headers={**AUTH, "content-type": "application/json"})
            assert r.status_code == 400 and "names the key" in r.json()["error"]["message"] and "twice" in r.text
        for method, path, body, status, message in cases:
            r = method(path, json=body, headers=AUTH)
            assert r.status_code == status and message in r.json()["error"]["message"], (path, body, r.json())
        assert client.get("/admin/routes/r", headers=AUTH).json()["targets"][0]["weight"] == 1.0


def test_kserve_http_names_the_target_in_a_header_and_keys_stick(tmp_path):
    with app_client(tmp_path, {"r": {"targets": {"m@1": 1, "m@2": 1, "m@3": 1}}}) as client:
        wait_ready(client)
        by_key = {}
        for _ in range(2):
            for i in range(20):
                r = client.post("/v2/models/r/infer", json=INFER, headers={**AUTH, "x-kiln-route-key": f"k{i}"})
                body = r.json()
                target = r.headers["x-kiln-route-target"]
                assert body["model_name"] == "r" and body["parameters"]["kiln_route_target"] == target
                assert target == f"m@{int(body['outputs'][0]['data'][0])}"
                by_key.setdefault(i, set()).add(target)
        assert all(len(t) == 1 for t in by_key.values())
        plain = client.post("/v2/models/m/versions/1/infer", json=INFER, headers=AUTH)
        assert "x-kiln-route-target" not in plain.headers and np.isclose(plain.json()["outputs"][0]["data"][0], 1)
        assert client.get("/v2/models/r/ready", headers=AUTH).status_code == 200
        assert client.get("/v2/models/r", headers=AUTH).json()["name"] == "r"


def test_an_error_answer_of_a_routed_request_names_its_target(tmp_path):
    # Only successes named the target: a client could not tell which version failed.
    with app_client(tmp_path, {"r": {"targets": {"m@2": 1}}}, fail_version=2) as client:
        wait_ready(client)
        r = client.post("/v2/models/r/infer", json=INFER, headers=AUTH)
        assert r.status_code == 500 and "injected" in r.json()["error"]
        assert r.headers["x-kiln-route-target"] == "m@2"
        bad = client.post("/v2/models/r/infer", json={"inputs": []}, headers=AUTH)
        assert bad.status_code == 400 and bad.headers["x-kiln-route-target"] == "m@2"
