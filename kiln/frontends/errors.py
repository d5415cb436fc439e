"""Kiln errors -> HTTP responses in OpenAI's shape, in one place.

    {"error": {"message": ..., "type": ..., "param": ..., "code": <status>}}

The status comes from the error class (`KilnError.http_status`, kiln/errors.py);
503s carry Retry-After.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kiln.errors import InvalidRequestError, KilnError
from kiln.frontends.routing import TARGET_HEADER

log = logging.getLogger(__name__)


def error_body(message: str, error_type: str, param: str | None, status: int) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_headers(exc: KilnError) -> dict[str, str]:
    """The headers an error answer carries, OpenAI and KServe alike: the route target, Retry-After on a 503."""
    headers = {TARGET_HEADER: exc.route_target} if exc.route_target is not None else {}
    retry_after = getattr(exc, "retry_after_s", None)
    if exc.http_status == 503 and retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return headers


def error_response(exc: KilnError) -> JSONResponse:
    headers = error_headers(exc)
    return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.http_status), exc.http_status, headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list"})


def _is_type_tag(part: object) -> bool:
    """A union member's name in an error location ("str", "list[int]", "constrained-str"), not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[]-"))


def _member_fits_items(err: ErrorDetails) -> bool:
    """Whether a list member of a union is the one the input's items are of: every member reports,
    and a list's length is checked before its items (131,073 token ids read "at most 4096 items",
    the limit of a list of strings)."""
    tag = next((p for p in err["loc"] if _is_type_tag(p)), "")
    value = err.get("input")
    if not isinstance(tag, str) or not tag.startswith("list[") or not isinstance(value, list) or not value:
        return True
    inner, first = tag[len("list["):], value[0]
    if isinstance(first, list):
        return inner.startswith("list[")
    if isinstance(first, str):
        return inner.startswith("str")
    if isinstance(first, int) and not isinstance(first, bool):
        return "int" in inner and not inner.startswith("list[")
    return True


def invalid_from_pydantic(e: ValidationError) -> InvalidRequestError:
    """The most telling validation problem, naming its field.

    For a union (`prompt: str | list[int] | ...`) every member reports; a
    broken bound of a member whose type fit ("prompt.0: less than or equal to
    ...") says more than "not a string", so such errors go first."""
    errors = e.errors()
    telling = [x for x in errors if not x["type"].endswith("_type")]
    err = next((x for x in telling if _member_fits_items(x)), telling[0] if telling else errors[0])
    parts = [str(p) for p in err["loc"] if not _is_type_tag(p)]
    loc = ".".join(parts) or None
    if err["type"] == "extra_forbidden":
        return InvalidRequestError(f"unknown field {loc!r}", param=loc)
    if err["type"] == "missing":
        return InvalidRequestError(f"missing required field {loc!r}", param=loc)
    return InvalidRequestError(f"{loc}: {err['msg']}" if loc else err["msg"], param=loc)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KilnError)
    async def kiln_error(request: Request, exc: KilnError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequestError(str(exc.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path}"
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, error_type, None, exc.status_code), exc.status_code, exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left while its body was being read: nobody to answer, nothing to log
        # (as a disconnect during a stream). 499 is the conventional code for it.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal server error", "internal_error", None, 500), 500)
