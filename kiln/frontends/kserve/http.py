"""KServe v2 REST routes (`kserve_router`).

Every handler reads its body under the size limit, calls the DataPlane and
turns a KilnError into `{"error": message}` with the error's own HTTP status
(kiln/errors.py holds the mapping). A client that disconnects while its
request is queued or running cancels it. Large bodies are inflated, parsed
and encoded in a worker thread (`INLINE_PARSE_BYTES`), so that one of them
does not hold up every other request on the event loop.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.routed import TARGET_PARAMETER
from kiln.errors import InvalidRequestError, KilnError
from kiln.frontends.errors import error_headers
from kiln.frontends.kserve import documents
from kiln.frontends.openapi import request_body
from kiln.frontends.routing import TARGET_HEADER, route_key
from kiln.serving.codecs.kserve_http import decode_json, encode_infer_response, parse_infer_request
from kiln.serving.codecs.limits import Limits
from kiln.serving.parameters import flag_parameter

log = logging.getLogger("kiln.kserve.http")
T = TypeVar("T")
HEADER_LENGTH = "Inference-Header-Content-Length"

# Bodies up to this size are parsed (and answers encoded) on the event loop: ~2 ms for a JSON body
# of floats, no more than handing it to a thread and back costs. Larger ones
# (up to 64 MiB: ~1 s) in a worker thread. msgspec holds the GIL while it
# decodes or encodes, as numpy does in tolist(), so the loop still waits for
# each such call; inflating and the Python between the calls let it run.
INLINE_PARSE_BYTES = 256 * 1024
# deflate (and gzip) inflate to at most ~1032 times their size: a compressed
# body of n bytes is an inflated body of up to n * this.
MAX_DEFLATE_RATIO = 1032

# The JSON bodies, for /openapi.json (the codecs check them; binary tensor data
# after an Inference-Header-Content-Length header is not described).
_PARAMETERS = {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}
INFER_REQUEST_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": _PARAMETERS,
        "inputs": {"type": "array", "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "shape", "datatype"],
            "properties": {
                "name": {"type": "string"},
                "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "datatype": {"type": "string", "enum": ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8",
                                                        "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16",
                                                        "BYTES"]},
                "parameters": _PARAMETERS,
                "data": {},
            },
        }},
        "outputs": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {"name": {"type": "string"}, "parameters": _PARAMETERS},
        }},
    },
}
INDEX_REQUEST_SCHEMA = {"type": "object", "properties": {"ready": {"type": "boolean"}}}
CONTROL_REQUEST_SCHEMA = {"type": "object", "properties": {"parameters": {"type": "object"}}}


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


def error_response(exc: KilnError) -> Response:
    response = _json({"error": exc.message}, exc.http_status)
    response.headers.update(error_headers(exc))
    return response


def _guard(handler):
    """Map KilnError (and anything unexpected) to the KServe error body."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except ClientGone:
            # Nobody reads this answer; returning one (rather than raising)
            # keeps a hang-up out of the server's error log.
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except KilnError as exc:
            return error_response(exc)
        except Exception as exc:  # noqa: BLE001 - never leak a traceback to the client
            log.exception("unexpected error in %s", handler.__name__)
            return _json({"error": f"internal error: {type(exc).__name__}"}, 500)

    return wrapper


async def read_body(request: Request, limits: Limits) -> bytes:
    """The request body, decompressed, refusing anything over the limit."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise InvalidRequestError(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise InvalidRequestError(_too_big(int(declared), limit))
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise InvalidRequestError(_too_big(total, limit))
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        body = await _off_loop(len(body) * MAX_DEFLATE_RATIO, _decompress, body, encoding, limit)
    elif encoding != "identity":
        raise InvalidRequestError(f"unsupported Content-Encoding {encoding!r}")
    return body


def _too_big(size: int, limit: int) -> str:
    return f"request body size of {size} bytes exceeds the maximum allowed input size of {limit} bytes"


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidRequestError(f"could not decompress the {encoding} body: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise InvalidRequestError(_too_big(len(out), limit) + " (after decompression)")
    return out


async def _off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """work(*args), in a worker thread when `size` bytes of input make it slow enough to hold up other requests."""
    if size <= INLINE_PARSE_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def _json_body(request: Request, limits: Limits) -> dict:
    body = await read_body(request, limits)
    if not body.strip():
        return {}
    doc = await _off_loop(len(body), decode_json, body, limits)
    if not isinstance(doc, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return doc


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the work was cancelled."""


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work):
    """Await `work` in this task; cancel it if the client goes away first.
    The watcher task starts only if `work` suspends: a fast model's request
    (kiln/serving/batching/batcher.py `_run_now`) finishes without ever
    yielding to the loop, and then the scheduled start is simply dropped."""
    task = asyncio.current_task()
    assert task is not None  # invariant: called from a coroutine under a running loop
    gone = False
    watcher: asyncio.Future | None = None

    async def watch() -> None:
        nonlocal gone
        await _until_disconnect(request)
        gone = True
        task.cancel()

    def start_watching() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(watch())

    start = asyncio.get_running_loop().call_soon(start_watching)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientGone from None
    finally:
        start.cancel()
        if watcher is not None:
            watcher.cancel()


def _version(version: str | None) -> str:
    return version or ""


@_guard
async def infer_response(dataplane: DataPlane, request: Request, name: str, version: str | None) -> Response:
    """POST /v2/models/{name}[/versions/{version}]/infer: body in, answer out."""
    limits = dataplane.limits
    body = await read_body(request, limits)
    header = request.headers.get(HEADER_LENGTH)
    if header is not None and not (header.isascii() and header.isdigit()):
        raise InvalidRequestError(f"invalid {HEADER_LENGTH} header {header!r}")
    args = (body, int(header) if header else None, name, _version(version), limits)
    # Inline for small bodies without the coroutine of _off_loop: this is every small request's path.
    infer_request = (parse_infer_request(*args) if len(body) <= INLINE_PARSE_BYTES
                     else await asyncio.to_thread(parse_infer_request, *args))
    key = route_key(request.headers)
    response = await _cancel_on_disconnect(request, dataplane.infer(infer_request, route_key=key))
    output_bytes = 0
    for array in response.outputs.values():
        output_bytes += array.nbytes  # its JSON text is no shorter
    payload, header_length = (encode_infer_response(response, infer_request) if output_bytes <= INLINE_PARSE_BYTES
                              else await asyncio.to_thread(encode_infer_response, response, infer_request))
    target = response.parameters.get(TARGET_PARAMETER)
    headers = {TARGET_HEADER: str(target)} if target is not None else {}
    if header_length is None:
        return Response(payload, media_type="application/json", headers=headers)
    return Response(payload, media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(header_length), **headers})


def kserve_router(dataplane: DataPlane) -> APIRouter:
    """The KServe v2 REST API (and its extensions) over `dataplane`."""
    router = APIRouter()
    limits = dataplane.limits

    @router.get("/v2")
    @_guard
    async def server_metadata():
        return _json(documents.server_metadata())

    @router.get("/v2/health/live")
    async def live():
        return Response(status_code=200 if dataplane.live() else 503)

    @router.get("/v2/health/ready")
    async def ready():
        return Response(status_code=200 if dataplane.ready() else 503)

    @router.get("/v2/models/stats")
    @_guard
    async def all_stats():
        return _json(documents.statistics(dataplane.model_statistics()))

    @router.get("/v2/models/{name}")
    @router.get("/v2/models/{name}/versions/{version}")
    @_guard
    async def model_metadata(name: str, version: str | None = None):
        config = dataplane.model_config(name, _version(version))
        return _json(documents.model_metadata(config, dataplane.model_versions(name)))

    @router.get("/v2/models/{name}/ready")
    @router.get("/v2/models/{name}/versions/{version}/ready")
    @_guard
    async def model_ready(name: str, version: str | None = None):
        return Response(status_code=200 if dataplane.model_ready(name, _version(version), unknown_raises=True) else 503)

    @router.get("/v2/models/{name}/config")
    @router.get("/v2/models/{name}/versions/{version}/config")
    @_guard
    async def model_config(name: str, version: str | None = None):
        return _json(documents.triton_config(dataplane.model_config(name, _version(version))))

    @router.get("/v2/models/{name}/stats")
    @router.get("/v2/models/{name}/versions/{version}/stats")
    @_guard
    async def model_stats(name: str, version: str | None = None):
        return _json(documents.statistics(dataplane.model_statistics(name, _version(version))))

    # The same handler serves these paths through InferFastPath (kiln/frontends/kserve/fast_path.py),
    # ahead of FastAPI's routing; the routes stay for /openapi.json and for apps without it.
    @router.post("/v2/models/{name}/infer", openapi_extra=request_body(INFER_REQUEST_SCHEMA))
    @router.post("/v2/models/{name}/versions/{version}/infer", openapi_extra=request_body(INFER_REQUEST_SCHEMA))
    async def infer(request: Request, name: str, version: str | None = None):
        return await infer_response(dataplane, request, name, version)

    @router.post("/v2/repository/index", openapi_extra=request_body(INDEX_REQUEST_SCHEMA))
    @_guard
    async def repository_index(request: Request):
        doc = await _json_body(request, limits)
        return _json(dataplane.repository_index(flag_parameter(doc, "ready")))

    @router.post("/v2/repository/models/{name}/load", openapi_extra=request_body(CONTROL_REQUEST_SCHEMA))
    @_guard
    async def load(request: Request, name: str):
        doc = await _json_body(request, limits)
        await dataplane.load_model(name, _parameters(doc))
        return Response(status_code=200)

    @router.post("/v2/repository/models/{name}/unload", openapi_extra=request_body(CONTROL_REQUEST_SCHEMA))
    @_guard
    async def unload(request: Request, name: str):
        doc = await _json_body(request, limits)
        await dataplane.unload_model(name, _parameters(doc))
        return Response(status_code=200)

    return router


def _parameters(doc: dict) -> dict:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequestError("'parameters' must be an object")
    return params
