"""InferFastPath: KServe v2 infer requests straight to their handler.

FastAPI's router tries its routes one by one (dozens here: OpenAI, admin,
dashboard, operations, KServe), each through its own matching machinery, and
then solves the endpoint's dependencies: together more per request than the
rest of serving a small model. This plain ASGI middleware answers
`POST /v2/models/{name}[/versions/{version}]/infer` itself, with the same
handler the FastAPI routes use (`infer_response`), and passes everything else
on. It sits inside the API-key middleware, so the key is checked first.
"""

from __future__ import annotations

import re

from starlette._utils import get_route_path
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.dataplane.dataplane import DataPlane
from kiln.frontends.kserve.http import infer_response

# The FastAPI routes' own patterns: a path parameter is one non-empty segment (scope["path"] is percent-decoded).
INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")


class InferFastPath:
    def __init__(self, app: ASGIApp, dataplane: DataPlane):
        self.app = app
        self.dataplane = dataplane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.fullmatch(get_route_path(scope))  # as Starlette's routes match
        if match is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        response = await infer_response(self.dataplane, request, match["name"], match["version"])
        await response(scope, receive, send)
