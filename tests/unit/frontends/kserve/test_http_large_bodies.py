"""Large KServe bodies are inflated and parsed in a worker thread, small ones
on the event loop; either way the result is the same."""
import asyncio
import gzip
import time

import msgspec

from kiln.frontends.kserve import http
from kiln.serving.codecs.limits import Limits


class BodyRequest:
    """The part of a Starlette request `read_body` reads."""

    def __init__(self, body: bytes, headers: dict[str, str]):
        self.body = body
        self.headers = {"content-length": str(len(body)), **headers}

    async def stream(self):
        for start in range(0, len(self.body), 1 << 16):
            yield self.body[start:start + (1 << 16)]


def infer_body(n: int) -> bytes:
    return msgspec.json.encode({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, n], "data": [1.5] * n}]})


def on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a worker thread runs no loop
        return False
    return True


def watch(monkeypatch, name: str) -> list[tuple[bool, float, float]]:
    """Wraps http.<name>: each call records (ran on the loop's thread, start, end)."""
    calls, real = [], getattr(http, name)

    def watched(*args):
        start = time.perf_counter()
        try:
            return real(*args)
        finally:
            calls.append((on_a_loop(), start, time.perf_counter()))
    monkeypatch.setattr(http, name, watched)
    return calls


async def ticking_while(work):
    """Runs `work` beside a coroutine that ticks every millisecond; returns (result, tick times)."""
    ticks: list[float] = []

    async def tick():
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)
    ticker = asyncio.create_task(tick())
    try:
        return await work, ticks
    finally:
        ticker.cancel()


def test_a_large_json_body_is_decoded_in_a_worker_thread_with_the_same_result(monkeypatch):
    calls = watch(monkeypatch, "decode_json")
    body = msgspec.json.encode({"parameters": {"pad": "x" * (http.INLINE_PARSE_BYTES + 1)}})
    doc = asyncio.run(http._json_body(BodyRequest(body, {}), Limits()))
    assert doc == msgspec.json.decode(body)
    assert [on_loop for on_loop, _, _ in calls] == [False]


def test_a_small_json_body_is_decoded_on_the_loop(monkeypatch):
    calls = watch(monkeypatch, "decode_json")
    doc = asyncio.run(http._json_body(BodyRequest(b'{"ready": true}', {}), Limits()))
    assert doc == {"ready": True} and [on_loop for on_loop, _, _ in calls] == [True]


def test_the_loop_keeps_running_while_a_large_gzip_body_is_inflated(monkeypatch):
    calls = watch(monkeypatch, "_decompress")
    body = infer_body(6_000_000)  # ~28 MiB
    request = BodyRequest(gzip.compress(body, 1), {"content-encoding": "gzip"})
    inflated, ticks = asyncio.run(ticking_while(http.read_body(request, Limits())))
    assert inflated == body
    [(on_loop, start, end)] = calls
    assert not on_loop
    assert sum(start < t < end for t in ticks) >= 3  # zlib lets go of the GIL: the loop ran meanwhile


def test_a_small_gzip_body_is_inflated_on_the_loop(monkeypatch):
    calls = watch(monkeypatch, "_decompress")
    body = infer_body(2)
    request = BodyRequest(gzip.compress(body), {"content-encoding": "gzip"})
    assert asyncio.run(http.read_body(request, Limits())) == body
    assert [on_loop for on_loop, _, _ in calls] == [True]


def test_a_large_infer_request_is_parsed_and_answered_off_the_loop_with_the_same_answer(monkeypatch):
    from tests.unit.frontends.kserve.test_fast_path import client
    parsed, encoded = watch(monkeypatch, "parse_infer_request"), watch(monkeypatch, "encode_infer_response")
    http_client, _ = client()
    n = http.INLINE_PARSE_BYTES // 4 + 1  # both the body and the FP32 answer are over the limit
    large = http_client.post("/v2/models/m/infer", content=infer_body(n), headers={"content-type": "application/json"})
    small = http_client.post("/v2/models/m/infer", content=infer_body(2), headers={"content-type": "application/json"})
    assert large.status_code == small.status_code == 200
    assert large.json()["outputs"] == [{"name": "OUT", "datatype": "FP32", "shape": [1, n], "data": [3.0] * n}]
    assert [on_loop for on_loop, _, _ in parsed] == [on_loop for on_loop, _, _ in encoded] == [False, True]
