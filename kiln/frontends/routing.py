"""Route headers every HTTP transport shares.

Request:  x-kiln-route-key: <key>     requests with one key go to one target while the weights stand
                                      (OpenAI: else the body's `user`)
          x-kiln-report-target: 1     OpenAI: the body's `model` names the target, not the route
Response: x-kiln-route-target: <model@version or model>   the target that served a routed request
gRPC uses the same names as metadata (key in, target in the trailing metadata).
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import Response

ROUTE_KEY_HEADER = "x-kiln-route-key"
TARGET_HEADER = "x-kiln-route-target"
REPORT_TARGET_HEADER = "x-kiln-report-target"
MAX_KEY_CHARS = 256


def route_key(headers: Mapping[str, str], user: str | None = None) -> str | None:
    key = headers.get(ROUTE_KEY_HEADER) or user or None
    return key[:MAX_KEY_CHARS] if key else None


def report_target(headers: Mapping[str, str]) -> bool:
    return headers.get(REPORT_TARGET_HEADER, "").strip().lower() in ("1", "true", "yes")


def with_target(response: Response, target: str | None) -> Response:
    if target is not None:
        response.headers[TARGET_HEADER] = target
    return response
