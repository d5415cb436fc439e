"""Wire tensors <-> numpy arrays: raw little-endian bytes and JSON lists.

Invariant: an array returned by `from_raw`/`from_json` has exactly the
declared datatype and shape; any mismatch is an InvalidRequestError naming
the tensor, never a silent cast or truncation.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kiln.errors import InvalidRequestError
from kiln.serving.codecs.limits import Limits
from kiln.serving.types import as_bytes_array, datatype_of, numpy_dtype

_INT_KINDS = "iu"


def check_shape(name: str, shape: Any, limits: Limits) -> int:
    """Validate a shape list and return its element count."""
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidRequestError(f"shape of tensor '{name}' must be a list of integers")
    if len(shape) > limits.max_dims:
        raise InvalidRequestError(f"tensor '{name}' has {len(shape)} dims, more than the limit of {limits.max_dims}")
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidRequestError(f"shape of tensor '{name}' has a negative dimension: {list(shape)}")
        count *= dim
        if count > limits.max_elements:
            raise InvalidRequestError(
                f"shape {list(shape)} of tensor '{name}' causes total element count to exceed "
                f"maximum size of {limits.max_elements}"
            )
    return count


# ---------------------------------------------------------------- raw bytes

def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor -> 4-byte little-endian length + bytes, per element."""
    parts = []
    for item in as_bytes_array(array).flat:
        parts.append(struct.pack("<I", len(item)))
        parts.append(item)
    return b"".join(parts)


def deserialize_bytes(name: str, raw: bytes | memoryview, count: int) -> np.ndarray:
    raw = memoryview(raw)
    # Every element carries a 4-byte length: a shape the data cannot fill is
    # refused before anything of its size is allocated.
    if count * 4 > len(raw):
        raise InvalidRequestError(
            f"expected {count} string elements for input '{name}', but its {len(raw)} bytes of data "
            f"hold at most {len(raw) // 4}"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(raw):
            raise InvalidRequestError(f"expected {count} string elements for input '{name}', got {i}")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidRequestError(f"string element {i} of input '{name}' runs past the end of its data")
        out[i] = bytes(raw[offset:offset + length])
        offset += length
    if offset != len(raw):
        raise InvalidRequestError(
            f"unexpected number of string elements for input '{name}': "
            f"{len(raw) - offset} bytes left after {count} elements"
        )
    return out


def from_raw(name: str, datatype: str, shape: list[int], raw: bytes | memoryview, limits: Limits) -> np.ndarray:
    count = check_shape(name, shape, limits)
    dtype = numpy_dtype(datatype)
    if datatype == "BYTES":
        return deserialize_bytes(name, raw, count).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidRequestError(
            f"input byte size mismatch for input '{name}'. Expected {expected}, got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def to_raw(array: np.ndarray) -> bytes:
    if datatype_of(array) == "BYTES":
        return serialize_bytes(array)
    return np.ascontiguousarray(array).tobytes()


# ---------------------------------------------------------------- JSON

def from_json(name: str, datatype: str, shape: list[int], data: Any, limits: Limits) -> np.ndarray:
    count = check_shape(name, shape, limits)
    dtype = numpy_dtype(datatype)
    if not isinstance(data, list):
        data = [data]
    if datatype == "BYTES":
        flat = _flatten_strings(name, data)
        _check_count(name, shape, count, len(flat))
        out = np.empty(len(flat), dtype=object)
        out[:] = flat
        return out.reshape(shape)
    try:
        array = np.asarray(data)
    except (ValueError, OverflowError):
        raise InvalidRequestError(f"Unable to parse 'data' of input '{name}': ragged or mixed values") from None
    if array.dtype == object or array.dtype.kind in "SU":
        raise InvalidRequestError(f"Unable to parse 'data' of input '{name}': expected {datatype} values")
    if array.ndim > 1 and list(array.shape) != list(shape):
        raise InvalidRequestError(
            f"Unable to parse 'data' of input '{name}': Shape does not match true shape of 'data' field"
        )
    _check_count(name, shape, count, array.size)
    return _cast(name, datatype, dtype, array).reshape(shape)


def _check_count(name: str, shape: list[int], count: int, got: int) -> None:
    if got != count:
        raise InvalidRequestError(
            f"unexpected number of elements for input '{name}': shape {list(shape)} needs {count}, got {got}"
        )


def _flatten_strings(name: str, data: list) -> list[bytes]:
    out: list[bytes] = []
    stack = [iter(data)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        elif isinstance(item, str):
            out.append(item.encode("utf-8"))
        else:
            raise InvalidRequestError(f"BYTES input '{name}' must hold JSON strings, got {type(item).__name__}")
    return out


_END = object()


def _cast(name: str, datatype: str, dtype: np.dtype, array: np.ndarray) -> np.ndarray:
    kind = array.dtype.kind
    if array.size == 0:
        return array.astype(dtype)
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidRequestError(f"input '{name}' is BOOL and needs true/false values")
        return array
    if dtype.kind in _INT_KINDS:
        if kind not in _INT_KINDS:
            raise InvalidRequestError(f"input '{name}' is {datatype} and needs integer values")
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidRequestError(f"a value of input '{name}' is out of range for {datatype}")
        return array.astype(dtype)
    if kind not in "iuf":
        raise InvalidRequestError(f"input '{name}' is {datatype} and needs numeric values")
    with np.errstate(over="ignore"):
        cast = array.astype(dtype)
    # A finite value beyond the type's range (1e300 as FP32, 70000 as FP16) would arrive as inf.
    if np.isinf(cast).any() and (np.isinf(cast) & np.isfinite(array)).any():
        raise InvalidRequestError(f"a value of input '{name}' is out of range for {datatype}")
    return cast


def to_json(name: str, array: np.ndarray) -> list:
    """Flat row-major JSON list for an output tensor."""
    datatype = datatype_of(array)
    if datatype == "BYTES":
        try:
            return [x.decode("utf-8") for x in as_bytes_array(array).flat]
        except UnicodeDecodeError:
            raise InvalidRequestError(
                f"output '{name}' holds bytes that are not UTF-8; request it with binary_data"
            ) from None
    if datatype in ("FP16", "BF16"):
        return array.astype(np.float32).ravel().tolist()
    return array.ravel().tolist()
