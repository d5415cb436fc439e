import struct

import msgspec
import numpy as np
import pytest

from kiln.errors import InvalidRequestError
from kiln.serving.codecs.kserve_http import encode_infer_response, parse_infer_request
from kiln.serving.codecs.limits import Limits
from kiln.serving.codecs.tensors import from_json, from_raw, serialize_bytes, to_json, to_raw
from kiln.serving.types import DTYPES, InferRequest, InferResponse, RequestedOutput

LIMITS = Limits()


@pytest.mark.parametrize("datatype", [d for d in DTYPES if d != "BYTES"])
def test_raw_roundtrip_every_fixed_datatype(datatype):
    array = (np.arange(6) % 2).astype(DTYPES[datatype]).reshape(2, 3)
    back = from_raw("x", datatype, [2, 3], to_raw(array), LIMITS)
    assert back.dtype == array.dtype and np.array_equal(back.astype(np.float64), array.astype(np.float64))


def test_bytes_serialization_roundtrip():
    array = np.array([b"a", b"", "\u00e9".encode()], dtype=object)
    raw = serialize_bytes(array)
    assert raw[:5] == struct.pack("<I", 1) + b"a"
    assert list(from_raw("s", "BYTES", [3], raw, LIMITS)) == list(array)


def test_raw_size_mismatch_names_the_sizes():
    with pytest.raises(InvalidRequestError, match="Expected 32, got 40"):
        from_raw("INPUT0", "FP32", [1, 8], b"\0" * 40, LIMITS)
    with pytest.raises(InvalidRequestError, match="string elements"):
        from_raw("s", "BYTES", [3], serialize_bytes(np.array([b"a"], dtype=object)), LIMITS)


@pytest.mark.parametrize("shape, fragment", [
    ([2, -5], "negative"),
    ([16, 2 ** 60 + 2], "exceed maximum size"),
    (["a"], "list of integers"),
    ([1] * 40, "dims"),
])
def test_bad_shapes(shape, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        from_json("x", "FP32", shape, [1.0], LIMITS)


def test_json_flat_and_nested_data():
    assert from_json("x", "INT32", [2, 2], [1, 2, 3, 4], LIMITS).tolist() == [[1, 2], [3, 4]]
    assert from_json("x", "INT32", [2, 2], [[1, 2], [3, 4]], LIMITS).dtype == np.int32
    with pytest.raises(InvalidRequestError, match="Shape does not match"):
        from_json("x", "INT32", [2, 2], [[1, 2, 3, 4]], LIMITS)
    with pytest.raises(InvalidRequestError, match="needs 4, got 3"):
        from_json("x", "INT32", [2, 2], [1, 2, 3], LIMITS)


@pytest.mark.parametrize("datatype, data, fragment", [
    ("INT32", [1.5], "integer"),
    ("UINT8", [300], "out of range"),
    ("BOOL", [1], "true/false"),
    ("FP32", ["a"], "expected FP32"),
    ("BYTES", [1], "JSON strings"),
    ("FP32", [[1], [1, 2]], "ragged"),
    ("FP32", [1.0, 1e300], "out of range for FP32"),  # was inf, silently
    ("FP16", [70000], "out of range for FP16"),
    ("BF16", [1e39], "out of range for BF16"),
])
def test_json_values_must_fit_the_datatype(datatype, data, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        from_json("x", datatype, [len(data)], data, LIMITS)


def test_infinities_and_nans_given_as_such_pass():
    out = from_json("x", "FP32", [3], [float("inf"), float("-inf"), float("nan")], LIMITS)
    assert np.isinf(out[:2]).all() and np.isnan(out[2]) and out.dtype == np.float32


def test_to_json_flattens_and_decodes_text():
    assert to_json("y", np.ones((2, 2), np.float16)) == [1.0] * 4
    assert to_json("y", np.array([b"hi"], dtype=object)) == ["hi"]
    with pytest.raises(InvalidRequestError, match="binary_data"):
        to_json("y", np.array([b"\xff"], dtype=object))


def _body(doc, binary=b""):
    header = msgspec.json.encode(doc)
    return header + binary, (len(header) if binary else None)


def test_parse_binary_request_and_encode_binary_response():
    a = np.arange(4, dtype=np.float32)
    body, length = _body({"inputs": [
        {"name": "A", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}},
        {"name": "B", "datatype": "INT64", "shape": [1], "data": [7]},
    ], "outputs": [{"name": "Y", "parameters": {"binary_data": True}}, {"name": "Z"}], "id": "r1"}, a.tobytes())
    request = parse_infer_request(body, length, "m", "", LIMITS)
    assert request.id == "r1" and np.array_equal(request.inputs["A"], a) and request.inputs["B"].tolist() == [7]
    response = InferResponse("m", "1", {"Y": a, "Z": np.array([1], np.int64)}, id="r1")
    payload, header_length = encode_infer_response(response, request)
    doc = msgspec.json.decode(payload[:header_length])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert doc["outputs"][1]["data"] == [1]
    assert payload[header_length:] == a.tobytes()


@pytest.mark.parametrize("doc, fragment", [
    ([1], "JSON object"),
    ({"inputs": "x"}, "list"),
    ({"inputs": [], "extra": 1}, "unknown field"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [1]}]}, "neither"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "data": [1]}] * 2}, "more than once"),
    ({"inputs": [{"name": "A", "datatype": "FP99", "shape": [1], "data": [1]}]}, "unknown datatype"),
    ({"inputs": [], "parameters": {"x": [1]}}, "parameters"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "data": [1], "parameters": {"binary_data_size": 0}}]},
     "both 'data' and 'binary_data_size'"),
])
def test_malformed_requests(doc, fragment):
    body, _ = _body(doc)
    with pytest.raises(InvalidRequestError, match=fragment):
        parse_infer_request(body, None, "m", "", LIMITS)


def test_header_length_and_unclaimed_bytes():
    body, _ = _body({"inputs": []})
    with pytest.raises(InvalidRequestError, match="out of range"):
        parse_infer_request(body, 99999999999, "m", "", LIMITS)
    with pytest.raises(InvalidRequestError, match="not claimed"):
        parse_infer_request(body + b"xx", len(body), "m", "", LIMITS)


def test_json_depth_limit():
    deep = b'{"inputs": [], "parameters": ' + b"[" * 150 + b"]" * 150 + b"}"
    with pytest.raises(InvalidRequestError, match=r"nesting depth exceeds maximum allowed limit \(100\)"):
        parse_infer_request(deep, None, "m", "", LIMITS)
    very_deep = b"[" * 250_000 + b"]" * 250_000
    with pytest.raises(InvalidRequestError, match="nesting depth"):
        parse_infer_request(very_deep, None, "m", "", LIMITS)
    ok = b'{"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 1], "data": [[1]]}]}'
    assert parse_infer_request(ok, None, "m", "", LIMITS).inputs["A"].shape == (1, 1)
    # Brackets inside strings count toward the quick bound but not the depth: still accepted.
    shallow = b'{"id": "' + b"[" * 150 + b'", ' + ok[1:]
    assert parse_infer_request(shallow, None, "m", "", LIMITS).id == "[" * 150
    # The JSON head of a binary request (a memoryview of the body) is checked the same way.
    head = b'{"inputs": [], "parameters": ' + b"[" * 150 + b"]" * 150 + b"}"
    with pytest.raises(InvalidRequestError, match="nesting depth"):
        parse_infer_request(head + b"\x00", len(head), "m", "", LIMITS)


def test_requested_output_default_binary_flag():
    request = InferRequest("m", {}, outputs=[RequestedOutput("Y")], parameters={"binary_data_output": True})
    payload, length = encode_infer_response(InferResponse("m", "1", {"Y": np.ones(2, np.int8)}), request)
    assert length is not None and payload[length:] == b"\x01\x01"


@pytest.mark.parametrize("where", ["http_binary", "raw_contents"])
def test_a_bytes_shape_its_data_cannot_fill_is_refused_before_any_allocation(where):
    """A 112-byte request with a BYTES shape of [2**28] and no data once allocated
    about 2 GB and blocked the event loop for seconds (issue 17). `raw_contents`
    is what gRPC's raw_input_contents go through (tests/integration/kserve/
    test_hardened_server.py sends both over the wire)."""
    import time
    import tracemalloc

    header = msgspec.json.encode({"inputs": [{"name": "T", "datatype": "BYTES", "shape": [2**28],
                                              "parameters": {"binary_data_size": 8}}]})
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(InvalidRequestError, match="hold at most 2"):
            if where == "http_binary":
                parse_infer_request(header + b"\0" * 8, len(header), "m", "", LIMITS)
            else:
                from_raw("T", "BYTES", [2**28], b"\0" * 8, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and time.perf_counter() - started < 0.5
