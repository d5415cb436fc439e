"""The API-key middleware: Bearer scheme, constant-time compare, open paths."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kiln.config import ServerConfig
from kiln.dataplane.dataplane import DataPlane
from kiln.frontends.auth import ApiKeyMiddleware
from kiln.server.app import build_app


def make_client(key: str = "k3y") -> TestClient:
    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/models", ok), Route("/health", ok), Route("/metrics", ok)])
    app.add_middleware(ApiKeyMiddleware, api_key=key)
    return TestClient(app)


def test_bearer_key_required_on_api_paths():
    client = make_client()
    assert client.get("/v1/models", headers={"Authorization": "Bearer k3y"}).text == "ok"
    assert client.get("/v1/models", headers={"Authorization": "bearer k3y"}).status_code == 200
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "k3y"},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic k3y"},
        {"Authorization": "Bearer k3y-and-more"},
    ):
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_stay_open():
    client = make_client()
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("protect_health", [False, True], ids=["health-open", "protect-health"])
def test_the_servers_key_guards_http_and_grpc_alike(tmp_path, protect_health):
    """The whole app with --api-key: every route and gRPC call needs the key, health,
    metrics and version only with --protect-health (checked with tritonclient)."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    from tests.integration.openai.live import free_port

    port = free_port()
    plane = DataPlane(ServerConfig(model_repository=str(tmp_path), api_key="k3y", grpc_port=port,
                                   protect_health=protect_health))
    key = {"authorization": "Bearer k3y"}
    with TestClient(build_app(plane)) as client:
        for path in ("/health", "/metrics", "/version", "/v2/health/live"):
            assert client.get(path).status_code == (401 if protect_health else 200), path
            assert client.get(path, headers=key).status_code == 200, path
        for path in ("/v1/models", "/openapi.json", "/v2"):
            assert client.get(path).status_code == 401, path
        assert client.post("/v2/models/m/infer", json={"inputs": []}).status_code == 401  # the fast path too
        assert client.post("/v2/models/m/infer", json={"inputs": []}, headers=key).status_code == 404
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            with pytest.raises(InferenceServerException, match="API key"):
                grpc.get_model_repository_index()
            assert grpc.get_model_repository_index(headers=key) is not None
            if protect_health:
                with pytest.raises(InferenceServerException, match="API key"):
                    grpc.is_server_live()
            assert grpc.is_server_live(headers=key if protect_health else None)
        finally:
            grpc.close()


def test_open_prefixes_serve_static_files_but_not_traversals():
    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/static/{path:path}", ok), Route("/data", ok)])
    app.add_middleware(ApiKeyMiddleware, api_key="k3y", open_prefixes=("/static/",))
    client = TestClient(app)
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/data").status_code == 401
    assert client.get("/staticx").status_code == 401  # a prefix, not a substring
    assert client.get("/static/%2e%2e/data").status_code == 401  # decoded '..' stays closed
