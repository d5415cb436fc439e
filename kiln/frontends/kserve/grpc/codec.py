"""ModelInferRequest/Response messages <-> InferRequest/InferResponse.

Inputs come either all as `raw_input_contents` (one entry per input, in
order) or all as typed `contents`; outputs always go back as
`raw_output_contents`, which every KServe v2 client reads.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kiln.errors import InvalidRequestError
from kiln.serving.codecs.limits import Limits
from kiln.serving.codecs.tensors import check_shape, from_raw, to_raw
from kiln.serving.types import InferRequest, InferResponse, RequestedOutput, datatype_of, numpy_dtype

# datatype -> the InferTensorContents field that carries it
CONTENT_FIELDS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def param_value(param) -> Any:
    """Python value of an InferParameter / ModelRepositoryParameter."""
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def set_param(param, value: Any) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def decode_request(message, limits: Limits) -> InferRequest:
    raw = list(message.raw_input_contents)
    if raw and len(raw) != len(message.inputs):
        raise InvalidRequestError(
            f"raw_input_contents has {len(raw)} entries but the request has {len(message.inputs)} inputs"
        )
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(message.inputs):
        if tensor.name in inputs:
            raise InvalidRequestError(f"input '{tensor.name}' appears more than once in the request")
        shape = list(tensor.shape)
        if raw:
            if tensor.HasField("contents"):
                raise InvalidRequestError(f"input '{tensor.name}' sets contents although raw_input_contents is used")
            inputs[tensor.name] = from_raw(tensor.name, tensor.datatype, shape, raw[index], limits)
        else:
            inputs[tensor.name] = _from_contents(tensor, shape, limits)
    outputs = None
    if message.outputs:
        outputs = [
            RequestedOutput(o.name, None, {k: param_value(v) for k, v in o.parameters.items()})
            for o in message.outputs
        ]
    return InferRequest(
        model_name=message.model_name,
        model_version=message.model_version,
        id=message.id,
        inputs=inputs,
        outputs=outputs,
        parameters={k: param_value(v) for k, v in message.parameters.items()},
    )


def _from_contents(tensor, shape: list[int], limits: Limits) -> np.ndarray:
    count = check_shape(tensor.name, shape, limits)
    dtype = numpy_dtype(tensor.datatype)
    field = CONTENT_FIELDS.get(tensor.datatype)
    if field is None:
        raise InvalidRequestError(f"{tensor.datatype} input '{tensor.name}' must be sent in raw_input_contents")
    values = list(getattr(tensor.contents, field))
    if len(values) != count:
        raise InvalidRequestError(
            f"unexpected number of elements for input '{tensor.name}': shape {shape} needs {count}, got {len(values)}"
        )
    if tensor.datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = values
        return array.reshape(shape)
    if dtype.kind in "iu" and values:
        info = np.iinfo(dtype)
        if min(values) < info.min or max(values) > info.max:
            raise InvalidRequestError(f"a value of input '{tensor.name}' is out of range for {tensor.datatype}")
    return np.asarray(values, dtype=dtype).reshape(shape)


def encode_response(pb2, response: InferResponse):
    message = pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for name, array in response.outputs.items():
        out = message.outputs.add()
        out.name = name
        out.datatype = datatype_of(array)
        out.shape.extend(int(d) for d in array.shape)
        message.raw_output_contents.append(to_raw(array))
    for key, value in response.parameters.items():
        set_param(message.parameters[key], value)
    return message
