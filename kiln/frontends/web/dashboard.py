"""The live dashboard: `/dashboard` (one page), its static files, and its data.

    GET /dashboard                 the page (no data in it: open, like its static files)
    GET /dashboard/static/...      JavaScript, CSS and the vendored chart library
    GET /dashboard/api/auth        {"api_key_required": bool} (open: the page asks before it shows a login)
    GET /dashboard/api/stats       everything the page shows, in one JSON document

With an API key set, the data endpoint (like every other API the page calls:
model control, routes, chat) needs `Authorization: Bearer <key>`; the page
asks for the key, keeps it in the tab's sessionStorage and sends it on each
call. The page itself holds no data and no secret, so it is served to
anyone (docs/operations.md, "Dashboard").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

import kiln
from kiln.dataplane.dataplane import DataPlane
from kiln.metrics.live_stats import LiveStats

STATIC = Path(__file__).resolve().parent / "static"
PAGE = "/dashboard"
STATIC_PREFIX = "/dashboard/static"
# Served without the API key: the page and its static files carry no data.
OPEN_PATHS = frozenset({PAGE, PAGE + "/", PAGE + "/api/auth"})
OPEN_PREFIXES = (STATIC_PREFIX + "/",)


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC)


def dashboard_router(dataplane: DataPlane) -> APIRouter:
    router = APIRouter()
    live = LiveStats(dataplane.registry)

    @router.get(PAGE)
    @router.get(PAGE + "/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @router.get(PAGE + "/api/auth")
    async def auth() -> dict:
        return {"api_key_required": dataplane.config.api_key is not None}

    @router.get(PAGE + "/api/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(dashboard_document(dataplane, live), headers={"Cache-Control": "no-store"})

    return router


def dashboard_document(dataplane: DataPlane, live: LiveStats) -> dict[str, Any]:
    models = model_rows(dataplane)
    llms = set(dataplane.llm_names())
    routes = dataplane.router.describe()
    figures = live.read(
        llms=[m["name"] for m in models if m["name"] in llms],
        models=[m["name"] for m in models if m["name"] not in llms],
        routes={r["name"]: [t["target"] for t in r["targets"]] for r in routes},
    )
    return {
        "server": {
            "version": kiln.__version__,
            "ready": dataplane.ready(),
            "draining": dataplane.draining,
            "auth": dataplane.config.api_key is not None,
            "price_per_hour_usd": dataplane.config.price_per_hour,
            "model_control": dataplane.config.model_control == "explicit",  # load/unload buttons
        },
        "models": models,
        "chat_models": dataplane.llm_names() + dataplane.llm_route_names(),
        "routes": routes,
        "stats": figures,
    }


def model_rows(dataplane: DataPlane) -> list[dict[str, Any]]:
    """Every model: its backend, state, loaded versions, and why it is not ready."""
    rows: dict[str, dict[str, Any]] = {}
    for entry in dataplane.repository_index():
        name = entry["name"]
        row = rows.setdefault(name, {"name": name, "versions": [], "state": "", "reason": ""})
        if "version" in entry:
            row["versions"].append(int(entry["version"]))
        row["state"] = entry.get("state", "") or row["state"]
        row["reason"] = entry.get("reason", "") or row["reason"]
    states = dataplane.model_states()
    for name, row in rows.items():
        config = dataplane.models.source_config(name)
        row["backend"] = config.backend if config is not None else ""
        row["state"] = "unloaded" if row["reason"] == "unloaded" else states.get(name, row["state"].lower())
        row["command_line"] = name in dataplane.command_line_models
    return sorted(rows.values(), key=lambda r: r["name"])
