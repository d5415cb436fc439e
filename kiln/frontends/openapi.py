"""OpenAPI request bodies for routes that parse their body by hand.

Kiln's routes read the body themselves (size limit, strict JSON, depth limit)
and then validate it with the request model, so FastAPI's generated schema
knows nothing of the body. `request_body(Model)` gives a route the model's
JSON schema as `openapi_extra`, without changing how the route parses: the
document at /openapi.json then describes every body (clients, docs,
schemathesis) and stays in step with the models it is made from.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

MAX_INLINE_DEPTH = 32  # request models nest a few levels; a self-referencing one stops here


def request_body(model: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` declaring a required JSON body of this model (or JSON schema)."""
    schema = json_schema(model) if not isinstance(model, dict) else model
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with its `$defs` inlined (a fragment of the
    OpenAPI document cannot point into a `$defs` of its own)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return _inline(schema, defs, 0)


def _inline(node: Any, defs: dict[str, Any], depth: int) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs, depth) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        if depth >= MAX_INLINE_DEPTH:
            return {"type": "object"}
        target = copy.deepcopy(defs[ref.removeprefix("#/$defs/")])
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return _inline({**target, **rest}, defs, depth + 1)
    return {key: _inline(value, defs, depth) for key, value in node.items()}
