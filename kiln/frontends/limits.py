"""Reading a request body within the size limit, as one JSON object."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from kiln.errors import InvalidRequestError


def too_large(size: int | str, limit: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"request body of {size} bytes exceeds this server's limit of {limit} bytes (max_request_bytes)",
        param="max_request_bytes",
    )


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(declared, max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large(f"more than {max_bytes}", max_bytes)
    if not body:
        raise InvalidRequestError("request body is empty; expected a JSON object")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"invalid JSON body: {e}") from e
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj
