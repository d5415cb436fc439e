"""KServe v2 HTTP bodies <-> InferRequest / InferResponse.

Handles the JSON form and the binary-data extension: a JSON header of
`Inference-Header-Content-Length` bytes followed by each binary input's
bytes, in input order, as announced by its `binary_data_size` parameter.
"""
from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kiln.errors import InvalidRequestError
from kiln.serving.codecs.limits import Limits
from kiln.serving.codecs.tensors import from_json, from_raw, to_json, to_raw
from kiln.serving.parameters import flag_parameter
from kiln.serving.types import InferRequest, InferResponse, RequestedOutput, datatype_of

_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "shape", "datatype", "parameters", "data"}
_OUTPUT_KEYS = {"name", "parameters"}


def decode_json(body: bytes | memoryview, limits: Limits) -> Any:
    """Parse a JSON body, enforcing the nesting-depth limit."""
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        raise _too_deep(limits) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"failed to parse the request JSON: {exc}") from None
    if _openings(body) > limits.max_json_depth and json_depth(value, limits.max_json_depth) > limits.max_json_depth:
        raise _too_deep(limits)
    return value


def _openings(body: bytes | memoryview) -> int:
    """Brackets and braces in the text: a bound on its nesting depth (those
    inside strings count too), at C speed, so most bodies skip the walk.
    (A memoryview, the JSON head of a binary request, is copied to count.)"""
    data = body if isinstance(body, bytes) else bytes(body)
    return data.count(b"[") + data.count(b"{")


def _too_deep(limits: Limits) -> InvalidRequestError:
    return InvalidRequestError(f"JSON nesting depth exceeds maximum allowed limit ({limits.max_json_depth})")


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of containers, stopping early once past `limit`."""
    if not isinstance(value, (list, dict)):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        kinds = set(map(type, children))  # at C speed: a tensor's flat `data` list holds no containers
        if list not in kinds and dict not in kinds:
            continue
        for child in children:
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))
    return deepest


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a parameter can be on gRPC (int64_param) too


def _params(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(v, (str, int, float, bool)) for v in value.values()
    ):
        raise InvalidRequestError(f"'parameters' of {where} must map names to string, number or boolean")
    for key, v in value.items():
        if isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX:
            raise InvalidRequestError(f"parameter '{key}' of {where} is outside int64")
    return value


def parse_infer_request(
    body: bytes, header_length: int | None, model: str, version: str, limits: Limits
) -> InferRequest:
    """Decode one HTTP infer body (JSON, or JSON header + binary tensors)."""
    if header_length is None:
        header_length = len(body)
    elif not 0 <= header_length <= len(body):
        raise InvalidRequestError(
            f"Inference-Header-Content-Length {header_length} is out of range for a body of {len(body)} bytes"
        )
    view = memoryview(body)
    doc = decode_json(body if header_length == len(body) else view[:header_length], limits)  # bytes: no copy
    if not isinstance(doc, dict):
        raise InvalidRequestError("the inference request must be a JSON object")
    unknown = set(doc) - _REQUEST_KEYS
    if unknown:
        raise InvalidRequestError(f"unknown field(s) in the inference request: {sorted(unknown)}")
    inputs = _parse_inputs(doc.get("inputs"), view[header_length:], limits)
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequestError("'id' must be a string")
    return InferRequest(
        model_name=model,
        model_version=version,
        id=request_id,
        inputs=inputs,
        outputs=_parse_outputs(doc.get("outputs")),
        parameters=_params(doc.get("parameters"), "the request"),
    )


def _parse_inputs(items: Any, binary: memoryview, limits: Limits) -> dict[str, np.ndarray]:
    if not isinstance(items, list):
        raise InvalidRequestError("'inputs' must be a list of tensors")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for item in items:
        if not isinstance(item, dict):
            raise InvalidRequestError("each input must be a JSON object")
        unknown = set(item) - _INPUT_KEYS
        if unknown:
            raise InvalidRequestError(f"unknown field(s) in input: {sorted(unknown)}")
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise InvalidRequestError("each input needs a string 'name' and 'datatype'")
        if not isinstance(shape, list):
            raise InvalidRequestError(f"shape of tensor '{name}' must be a list of integers")
        if name in inputs:
            raise InvalidRequestError(f"input '{name}' appears more than once in the request")
        params = _params(item.get("parameters"), f"input '{name}'")
        size = params.get("binary_data_size")
        if size is not None and "data" in item:  # which one is the tensor? (gRPC refuses both too)
            raise InvalidRequestError(f"input '{name}' has both 'data' and 'binary_data_size'; give one")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise InvalidRequestError(f"binary_data_size of input '{name}' does not fit the request body")
            inputs[name] = from_raw(name, datatype, shape, binary[offset:offset + size], limits)
            offset += size
        elif "data" in item:
            inputs[name] = from_json(name, datatype, shape, item["data"], limits)
        else:
            raise InvalidRequestError(f"input '{name}' has neither 'data' nor 'binary_data_size'")
    if offset != len(binary):
        raise InvalidRequestError(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    return inputs


def _parse_outputs(items: Any) -> list[RequestedOutput] | None:
    if items is None:
        return None
    if not isinstance(items, list):
        raise InvalidRequestError("'outputs' must be a list")
    outputs: list[RequestedOutput] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidRequestError("each requested output needs a string 'name'")
        unknown = set(item) - _OUTPUT_KEYS
        if unknown:
            raise InvalidRequestError(f"unknown field(s) in requested output: {sorted(unknown)}")
        params = _params(item.get("parameters"), f"output '{item['name']}'")
        binary = None if params.get("binary_data") is None else flag_parameter(params, "binary_data")
        outputs.append(RequestedOutput(item["name"], binary, params))
    return outputs


def encode_infer_response(response: InferResponse, request: InferRequest) -> tuple[bytes, int | None]:
    """JSON body (+ binary outputs). Returns (body, header length or None)."""
    default_binary = flag_parameter(request.parameters, "binary_data_output")
    wanted = {o.name: o for o in request.outputs} if request.outputs is not None else None
    tensors, chunks = [], []
    for name, array in response.outputs.items():
        spec: dict[str, Any] = {"name": name, "datatype": datatype_of(array), "shape": list(array.shape)}
        requested = wanted.get(name) if wanted is not None else None
        binary = requested.binary if requested is not None and requested.binary is not None else default_binary
        if binary:
            raw = to_raw(array)
            spec["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            spec["data"] = to_json(name, array)
        tensors.append(spec)
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = tensors
    header = msgspec.json.encode(doc)
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)
