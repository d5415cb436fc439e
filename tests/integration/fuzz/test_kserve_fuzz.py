"""Property-based fuzzing of KServe v2 infer bodies (JSON and binary) against
a live server: any body gets 200 or a 4xx, never a 5xx or a hang, and the
server serves normally right after (issue 17)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tests.integration.fuzz.checks import FUZZ, encode, post_expecting_an_answer, still_serving
from tests.integration.fuzz.strategies import INFER, KSERVE_MODELS


@FUZZ
@given(model=KSERVE_MODELS, body=INFER)
def test_infer_json(fuzz_server, model, body):
    post_expecting_an_answer(fuzz_server, f"/v2/models/{model}/infer", encode(body))
    still_serving(fuzz_server)


@FUZZ
@given(model=KSERVE_MODELS, body=INFER, binary=st.binary(max_size=64), cut=st.integers(-8, 8))
def test_infer_binary(fuzz_server, model, body, binary, cut):
    """A JSON header announcing binary tensors, then bytes that may or may not fit."""
    for tensor in body.get("inputs", []) if isinstance(body.get("inputs"), list) else []:
        if isinstance(tensor, dict):
            tensor.setdefault("parameters", {"binary_data_size": len(binary)})
    header = json.dumps(body, ensure_ascii=True, allow_nan=True).encode()
    length = max(0, len(header) + cut)
    post_expecting_an_answer(fuzz_server, f"/v2/models/{model}/infer", header + binary,
                             headers={"Inference-Header-Content-Length": str(length)})
    still_serving(fuzz_server)
