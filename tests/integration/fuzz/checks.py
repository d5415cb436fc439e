"""What every fuzzed request must get: an answer (200 or 4xx, never 5xx, in
time), a stream that ends properly, and a server that serves a normal request
right after, with the engine it started with."""

from __future__ import annotations

import json
import os

import httpx
from hypothesis import HealthCheck, settings

TIMEOUT_S = 30.0
JSON = {"content-type": "application/json"}

# Bounded for `make test`; KILN_FUZZ_EXAMPLES=2000 KILN_FUZZ_RANDOM=1 searches longer and afresh.
FUZZ = settings(
    max_examples=int(os.environ.get("KILN_FUZZ_EXAMPLES", "80")),
    derandomize=not os.environ.get("KILN_FUZZ_RANDOM"),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def encode(body: object) -> bytes:
    """JSON as a client may send it: lone surrogates as escapes, NaN/Infinity as literals."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def post_expecting_an_answer(server, path: str, raw: bytes, headers: dict | None = None) -> httpx.Response:
    with server.client.stream("POST", server.base_url + path, content=raw, headers={**JSON, **(headers or {})},
                              timeout=TIMEOUT_S) as r:
        r.read()
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, raw[:300], r.content[:300])
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for event in events[:-1]:
            error = json.loads(event).get("error")
            assert error is None or error["code"] < 500, (raw[:300], event)
    return r


def still_serving(server) -> None:
    r = server.client.post(server.base_url + "/v1/completions", timeout=TIMEOUT_S,
                           json={"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert server.engine_pid() == server.first_engine_pid  # the same engine: nothing killed it
