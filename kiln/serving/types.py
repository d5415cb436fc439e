"""Tensors, requests and responses as the serving data plane sees them.

Every tensor is a numpy array. Its KServe datatype follows from the array's
dtype (`datatype_of`), so there is never a second, disagreeing copy of it.
BYTES tensors are object arrays whose elements are `bytes`; BF16 tensors use
`ml_dtypes.bfloat16` (optional dependency; BF16 is refused without it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.errors import InvalidRequestError

try:  # BF16 has no numpy dtype of its own.
    import ml_dtypes

    _BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes comes with onnx/tritonclient
    _BF16 = None

# KServe datatype -> numpy dtype. BYTES is object; BF16 may be None.
DTYPES: dict[str, Any] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": _BF16,
    "BYTES": np.dtype(object),
}
DATATYPES = tuple(DTYPES)
_BY_DTYPE = {v: k for k, v in DTYPES.items() if v is not None}


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype for a KServe datatype name; 400 for an unknown name."""
    dtype = DTYPES.get(datatype)
    if dtype is None:
        if datatype == "BF16":
            raise InvalidRequestError("BF16 tensors need the ml_dtypes package on the server")
        raise InvalidRequestError(f"unknown datatype '{datatype}'; expected one of {list(DATATYPES)}")
    return dtype


def datatype_of(array: np.ndarray) -> str:
    """The KServe datatype name of an array (str/bytes arrays count as BYTES)."""
    if array.dtype.kind in "SUO":
        return "BYTES"
    name = _BY_DTYPE.get(array.dtype)
    if name is None:
        raise InvalidRequestError(f"arrays of dtype {array.dtype} have no KServe datatype")
    return name


def element_size(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype (0 for BYTES)."""
    return 0 if datatype == "BYTES" else numpy_dtype(datatype).itemsize


def as_bytes_array(array: np.ndarray) -> np.ndarray:
    """Normalise a str/bytes/object array to an object array of `bytes`."""
    if array.dtype == object and all(isinstance(x, bytes) for x in array.flat):
        return array
    out = np.empty(array.shape, dtype=object)
    for index, item in np.ndenumerate(array):
        if isinstance(item, str):
            out[index] = item.encode("utf-8")
        elif isinstance(item, (bytes, bytearray, memoryview)):
            out[index] = bytes(item)
        else:  # bytes(5) would be five zero bytes
            raise TypeError(f"a BYTES element must be str or bytes, got {type(item).__name__}")
    return out


@dataclass
class RequestedOutput:
    """An output the client asked for; `binary` asks for the binary-data form."""

    name: str
    binary: bool | None = None  # None = transport default
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """One inference request. `inputs` maps input name to array.

    `outputs` None means "all outputs". `model_version` "" means the version
    chosen by the model's version policy (the highest loaded).
    """

    model_name: str
    inputs: dict[str, np.ndarray]
    model_version: str = ""
    id: str = ""
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    def batch_size(self) -> int:
        """Size of the first dimension of the first input (1 for scalars)."""
        for array in self.inputs.values():
            return int(array.shape[0]) if array.ndim else 1
        return 0


@dataclass
class InferResponse:
    """One inference response; `outputs` maps output name to array."""

    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
