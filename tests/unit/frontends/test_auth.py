"""The API-key middleware: Bearer scheme, constant-time compare, open paths."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kiln.frontends.auth import ApiKeyMiddleware


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
