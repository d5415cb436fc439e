"""The ASGI app: routers over one DataPlane, errors in OpenAI's shape.

    app = build_app(dataplane)              # OpenAI + ops routes
    app.include_router(kserve_router(dataplane))   # more transports compose

The lifespan loads the models in the background, so /health can answer 503
while they load, and shuts the engines down after uvicorn has drained.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from kiln.frontends.auth import ApiKeyMiddleware
from kiln.frontends.dataplane import DataPlane
from kiln.frontends.errors import install_error_handlers
from kiln.frontends.openai.router import openai_router
from kiln.frontends.ops import ops_router


def build_app(dataplane: DataPlane) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(dataplane.start())
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loading
            await dataplane.shutdown()

    app = FastAPI(title="Kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dataplane = dataplane
    install_error_handlers(app)
    if dataplane.settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=dataplane.settings.api_key)
    app.include_router(ops_router(dataplane))
    app.include_router(openai_router(dataplane))
    if dataplane.repository is not None:
        from kiln.frontends.kserve.http import add_kserve_routes

        add_kserve_routes(app, dataplane.repository)
    return app
