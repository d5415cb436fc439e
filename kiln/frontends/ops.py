"""Operations endpoints: /health, /metrics, /version (open even with an API key,
unless the server runs with --protect-health)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kiln
from kiln.dataplane.dataplane import DataPlane


def ops_router(dataplane: DataPlane) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        """200 when the server is ready (every model loaded, no engine dead, not draining); 503 otherwise,
        with status draining, restarting (an LLM engine died and a new one is starting) or unavailable."""
        ok = dataplane.ready()
        states = dataplane.model_states()
        if ok:
            status = "ok"
        elif dataplane.draining:
            status = "draining"
        else:
            status = "restarting" if "restarting" in states.values() else "unavailable"
        return JSONResponse({"status": status, "models": states}, status_code=200 if ok else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(dataplane.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version() -> dict:
        return {"version": kiln.__version__}

    return router
