"""The app before its model is ready: /health 503, requests 503 with Retry-After."""

from __future__ import annotations

import gzip

from starlette.testclient import TestClient

from kiln.config import EngineConfig, ServerConfig
from kiln.dataplane.dataplane import DataPlane
from kiln.server.app import KilnApp, build_app


def loading_app(**settings) -> tuple[TestClient, DataPlane]:
    dataplane = DataPlane(ServerConfig(**settings))
    dataplane.add_llm(EngineConfig.from_flat(model="/nonexistent/model"), name="m")
    return TestClient(build_app(dataplane)), dataplane  # no `with`: the lifespan (loading) never runs


def test_health_is_503_while_loading_and_requests_say_so():
    client, _ = loading_app()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["models"] == {"m": "loading"}
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["type"] == "model_loading_error"
    assert client.get("/version").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_kserve_routes_see_the_same_model_loading():
    client, _ = loading_app()
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 503
    assert client.get("/v2/models/m/ready").status_code == 503
    index = client.post("/v2/repository/index", json={}).json()
    assert index == [{"name": "m", "state": "LOADING", "reason": ""}]


def test_unknown_model_is_404_even_while_loading():
    client, _ = loading_app()
    r = client.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.get("/v2/models/other/ready")  # a mistyped readiness probe: not "still loading"
    assert r.status_code == 404 and "'other' is not found" in r.json()["error"]
    assert client.get("/v2/models/m/versions/²/ready").status_code == 400  # was a 500 (int('²') fails)
    length = {"Inference-Header-Content-Length": "²".encode("latin-1")}
    r = client.post("/v2/models/m/infer", headers=length, content=b"{}")
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]


def test_draining_refuses_new_requests():
    client, dataplane = loading_app()
    dataplane.draining = True
    assert client.get("/health").json()["status"] == "draining"
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_draining_error"


def test_metrics_registry_is_per_server():
    a, _ = loading_app()
    b, _ = loading_app()  # a second server in the same process: no duplicate-metric clash
    assert "kiln:num_requests_running" in a.get("/metrics").text
    assert "kiln:num_requests_running" in b.get("/metrics").text


def test_infer_requests_are_answered_in_front_of_fastapis_stack(monkeypatch):
    """KServe infer posts go straight to their handler; everything else reaches FastAPI."""
    behind = []
    through = KilnApp.behind_front

    async def counted(self, scope, receive, send):
        behind.append((scope["method"], scope["path"]))
        await through(self, scope, receive, send)

    monkeypatch.setattr(KilnApp, "behind_front", counted)
    client, _ = loading_app()
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
    r = client.post("/v2/models/m/infer", json=body)
    assert r.status_code == 503 and "loading" in r.json()["error"]
    assert client.post("/v2/models/m/versions/1/infer", json=body).status_code == 503
    assert client.get("/v2/models/m/ready").status_code == 503
    assert behind == [("GET", "/v2/models/m/ready")]


def test_a_client_that_leaves_while_sending_its_body_is_not_a_server_error(caplog):
    # It was logged as "unhandled error" with two tracebacks (ours and uvicorn's).
    import asyncio

    client, _ = loading_app()
    app = client.app
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")],
             "http_version": "1.1", "scheme": "http", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
             "root_path": "", "app": app}
    messages = [{"type": "http.request", "body": b'{"prompt": "hi"', "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_kserve_503s_carry_retry_after_like_the_openai_routes():
    client, dataplane = loading_app()
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
    r = client.post("/v2/models/m/infer", json=body)
    assert r.status_code == 503 and r.headers["retry-after"] == "5", (r.status_code, r.text)
    assert "retry-after" not in client.post("/v2/models/other/infer", json=body).headers  # a 404
    dataplane.draining = True
    r = client.post("/v2/models/m/infer", json=body)
    assert r.status_code == 503 and r.headers["retry-after"] == "5", (r.status_code, r.text)


def test_a_compressed_openai_body_is_refused_naming_its_content_encoding():
    client, _ = loading_app()
    r = client.post("/v1/completions", content=gzip.compress(b'{"prompt": "x"}'),
                    headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "unsupported Content-Encoding 'gzip': send the JSON body uncompressed"
