"""KServe request parameters read as the types they name: a flag that is
not a boolean, or a timeout that is not a non-negative number, is a 400
naming it, never read by Python's truthiness ("false" is a non-empty string)
nor dropped."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.errors import InvalidRequestError

_FLAG_TEXT = {"true": True, "false": False}


def flag_parameter(parameters: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """A boolean parameter; "true"/"false" text too (gRPC clients send string_param)."""
    value = parameters.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _FLAG_TEXT:
        return _FLAG_TEXT[value.lower()]
    raise InvalidRequestError(f"parameter '{name}' must be a boolean, got {value!r}", param=name)


def timeout_parameter_s(parameters: Mapping[str, Any], default_s: float) -> float:
    """KServe's `timeout` in microseconds as seconds; 0 or absent: `default_s`."""
    value = parameters.get("timeout", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidRequestError(
            f"parameter 'timeout' must be a non-negative number of microseconds, got {value!r}", param="timeout")
    return value / 1e6 if value > 0 else default_s
