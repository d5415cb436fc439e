"""Reading a request body within the size limit, as one JSON object, and what
any value in a body may be.

Bodies are not compressed (a Content-Encoding other than identity is 400):
they are small (`max_request_bytes`) and inflating them would be one more
limit to keep. KServe bodies, which carry tensors, may be (kserve/http.py).

The body is parsed strictly (msgspec: no NaN/Infinity, no lone surrogates)
and refused past `MAX_JSON_DEPTH` levels of nesting, before any model sees it.
When the fast parser refuses a body, the lenient one re-reads it only to
name the field at fault (a lone surrogate, a number out of range).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
from fastapi import Request

from kiln.config_text import duplicate_json_key
from kiln.errors import InvalidRequestError
from kiln.serving.codecs.kserve_http import json_depth

MAX_JSON_DEPTH = 100
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def too_large(size: int | str, limit: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"request body of {size} bytes exceeds this server's limit of {limit} bytes (max_request_bytes)",
        param="max_request_bytes",
    )


async def read_json_object(request: Request, max_bytes: int, unique_keys: bool = False) -> dict[str, Any]:
    """The body as a JSON object; `unique_keys`: a key named twice in an object is an error
    (configuration documents, where the last value would win in silence)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # else the compressed bytes would be refused as "invalid JSON"
        raise InvalidRequestError(f"unsupported Content-Encoding {encoding!r}: send the JSON body uncompressed")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(declared, max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large(f"more than {max_bytes}", max_bytes)
    if not body:
        raise InvalidRequestError("request body is empty; expected a JSON object")
    obj = parse_json(bytes(body))
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(obj).__name__}")
    duplicate = duplicate_json_key(bytes(body)) if unique_keys else None
    if duplicate is not None:
        raise InvalidRequestError(f"the JSON body names the key {duplicate!r} twice in one object")
    return obj


def parse_json(body: bytes) -> Any:
    """A JSON document at most MAX_JSON_DEPTH deep (valid UTF-8 text, finite numbers)."""
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as e:
        _name_the_culprit(body)
        raise InvalidRequestError(f"invalid JSON body: {e}") from None
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise _too_deep()
    return value


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})")


def _name_the_culprit(body: bytes) -> None:
    """If the lenient parser reads what the strict one refused, say which value is at fault."""
    try:
        value = json.loads(body, parse_int=_integer)
    except (ValueError, RecursionError):
        return
    check_representable(value)


class _LongDigits(str):
    """An integer literal too long for Python's int() (4,300 digits): kept as its text, refused by name."""


def _integer(text: str) -> int | _LongDigits:
    return int(text) if len(text) <= 64 else _LongDigits(text)


def check_representable(value: Any, path: str = "") -> None:
    """InvalidRequestError naming the first value no downstream layer can carry.

    Iterative (a body nested 100k deep must not exhaust the stack; the JSON
    reader refuses such bodies first, this is the backstop)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, _LongDigits):
            raise InvalidRequestError(f"{where or 'value'}: an integer of {len(item.lstrip('-'))} digits is outside "
                                      "int64", param=where or None)
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                raise InvalidRequestError(f"{where or 'value'}: integer {item} is outside int64", param=where or None)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidRequestError(f"{where or 'value'}: number must be finite", param=where or None)
        elif isinstance(item, dict):
            for key, child in item.items():
                name = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else str(key)
                child_path = f"{where}.{name}" if where else name
                if isinstance(key, str):
                    _check_text(key, child_path)
                stack.append((child, child_path))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{where}.{i}" if where else str(i)) for i, child in enumerate(item))


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(
            f"{where or 'value'}: string is not valid UTF-8 text (it holds a lone surrogate)", param=where or None
        ) from None
