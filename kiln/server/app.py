"""The ASGI app: every HTTP route (OpenAI, KServe v2, operations, admin, the
/dashboard page) over one data plane, plus the gRPC server, started and
stopped with the app.

The lifespan opens the ports at once and loads the models in the background,
so /health answers 503 while they load (unless the data plane's owner loaded
them already: a Ray Serve replica does, so that it takes traffic only once
it can serve). A command-line model that fails to
load stops the server (`on_fatal`); a repository model that fails is
reported and the others serve. On shutdown (after uvicorn drained) the gRPC
server stops, then every model unloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import kiln
from kiln.dataplane.dataplane import DataPlane
from kiln.frontends.admin import admin_router
from kiln.frontends.auth import OPEN_PATHS, ApiKeyMiddleware
from kiln.frontends.errors import install_error_handlers
from kiln.frontends.kserve.fast_path import InferFastPath
from kiln.frontends.kserve.grpc.servicer import start_grpc_server
from kiln.frontends.kserve.http import kserve_router
from kiln.frontends.openai.router import openai_router
from kiln.frontends.ops import ops_router
from kiln.frontends.web import dashboard

log = logging.getLogger(__name__)
OPENAPI_PATH = "/openapi.json"


class KilnApp(FastAPI):
    """FastAPI behind a front door: every HTTP request first passes `front`
    (the API key check, then the KServe infer fast path), and only what the
    front passes on pays for FastAPI's own per-request machinery (its
    telemetry check, middleware stack and router): on a small model those
    cost as much as the inference."""

    front: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.front is not None and scope["type"] == "http":
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def behind_front(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def build_app(dataplane: DataPlane, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        grpc_server = await _start_grpc(dataplane)
        loading = None if dataplane.started else asyncio.create_task(_load(dataplane, on_fatal))
        try:
            yield
        finally:
            if loading is not None:
                loading.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await loading
            if grpc_server is not None:
                await grpc_server.stop(grace=5)
            await dataplane.shutdown()

    # The OpenAPI document (every route, every JSON body) is served at /openapi.json,
    # behind the API key like every route but health, metrics and version.
    app = KilnApp(title="Kiln", version=kiln.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=OPENAPI_PATH)
    app.state.dataplane = dataplane
    install_error_handlers(app)
    front: ASGIApp = InferFastPath(app.behind_front, dataplane)
    if dataplane.config.api_key:
        probes = frozenset() if dataplane.config.protect_health else OPEN_PATHS
        front = ApiKeyMiddleware(front, api_key=dataplane.config.api_key,
                                 open_paths=probes | dashboard.OPEN_PATHS, open_prefixes=dashboard.OPEN_PREFIXES)
    app.front = front
    app.include_router(ops_router(dataplane))
    app.include_router(dashboard.dashboard_router(dataplane))
    app.mount(dashboard.STATIC_PREFIX, dashboard.static_files(), name="dashboard-static")
    app.include_router(admin_router(dataplane))
    app.include_router(openai_router(dataplane))
    app.include_router(kserve_router(dataplane))
    return app


async def _start_grpc(dataplane: DataPlane):
    config = dataplane.config
    port = config.grpc_port_resolved
    if port < 0:
        return None
    server = await start_grpc_server(dataplane, config.host, port)
    log.info("KServe v2 gRPC on %s:%d", config.host, server.bound_port)
    return server


async def _load(dataplane: DataPlane, on_fatal: Callable[[str], None] | None) -> None:
    errors = await dataplane.start()
    fatal = [f"{name}: {errors[name]}" for name in dataplane.command_line_models if name in errors]
    if fatal and on_fatal is not None:
        on_fatal(fatal[0])
