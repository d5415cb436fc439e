"""Admin API for routes (behind the API key when one is set).

    GET    /admin/routes          every route: targets, weights, shares, shadows, canary state
    GET    /admin/routes/{name}   one route
    PUT    /admin/routes/{name}   create or replace a route; body: a routes.yaml entry as JSON
    PATCH  /admin/routes/{name}   {"weights": {"model@2": 50}}: new weights for some targets
                                  (others keep theirs); stops the route's canary
    DELETE /admin/routes/{name}   remove a route

Changes apply to requests that arrive afterwards; requests already routed
finish on their target. They live in memory: a restart reads routes.yaml.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.routing.spec import parse_route, parse_weights
from kiln.frontends.limits import read_json_object


def admin_router(dataplane: DataPlane) -> APIRouter:
    router = APIRouter()
    routes = dataplane.router
    limit = dataplane.config.max_request_bytes

    @router.get("/admin/routes")
    async def list_routes() -> dict:
        return {"routes": routes.describe()}

    @router.get("/admin/routes/{name}")
    async def get_route(name: str) -> dict:
        return routes.route(name).describe()

    @router.put("/admin/routes/{name}")
    async def put_route(name: str, request: Request) -> dict:
        spec = parse_route(await read_json_object(request, limit, unique_keys=True), name)
        return routes.put(name, spec).describe()

    @router.patch("/admin/routes/{name}")
    async def patch_route(name: str, request: Request) -> dict:
        weights = parse_weights(await read_json_object(request, limit, unique_keys=True))
        return routes.patch(name, weights).describe()

    @router.delete("/admin/routes/{name}")
    async def delete_route(name: str) -> dict:
        routes.remove(name)
        return {"deleted": name}

    return router
