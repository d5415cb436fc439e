"""Optional API key: `Authorization: Bearer <key>`, compared in constant time,
on every transport (this HTTP middleware; kserve/grpc/auth.py for gRPC).

A plain ASGI middleware (streaming responses pass through untouched). Health,
metrics and version stay open so probes and scrapers need no secret, unless
the server runs with --protect-health; so do the paths the server adds for
pages that hold no data (the dashboard's page and static files: `open_paths`,
`open_prefixes`), even with --protect-health.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.errors import AuthenticationError
from kiln.frontends.errors import error_response

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/v2/health/live", "/v2/health/ready"})
UNAUTHORIZED = "missing or invalid API key (expected 'Authorization: Bearer <key>')"


def bearer_matches(header: bytes, key: bytes) -> bool:
    """True if an Authorization header value carries `key` (scheme case-insensitive)."""
    scheme, _, token = header.partition(b" ")
    # compare_digest takes time independent of where the bytes differ.
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


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
        response = error_response(AuthenticationError(UNAUTHORIZED))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        return bearer_matches(header, self.key)
