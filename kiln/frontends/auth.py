"""Optional API key: `Authorization: Bearer <key>`, compared in constant time.

A plain ASGI middleware (streaming responses pass through untouched). Health,
metrics and version stay open so probes and scrapers need no secret; so do
the paths the server adds for pages that hold no data (the dashboard's page
and static files: `open_paths`, `open_prefixes`).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.errors import AuthenticationError
from kiln.frontends.errors import error_response

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/v2/health/live", "/v2/health/ready"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS,
                 open_prefixes: tuple[str, ...] = ()):
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes

    def _open(self, path: str) -> bool:
        # Starlette serves a path with '..' segments as the literal name it is (static files refuse traversal).
        return path in self.open_paths or (path.startswith(self.open_prefixes) and ".." not in path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._open(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            AuthenticationError("missing or invalid API key (expected 'Authorization: Bearer <key>')")
        )
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        # compare_digest takes time independent of where the bytes differ.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
