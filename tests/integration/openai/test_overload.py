"""A full queue answers 503 + Retry-After at once; nothing hangs.

One sequence runs at a time and at most one request may wait for its first
token, so a burst of requests overflows immediately.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.openai.live import kiln_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    flags = ["--num-blocks", "64", "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-queued-requests", "1"]
    with kiln_server(tiny_llama_dir, *flags, tmp_dir=tmp_path_factory.mktemp("overload")) as s:
        yield s


async def timed_post(client: httpx.AsyncClient, url: str, stream: bool) -> tuple[int, float, httpx.Headers, bytes]:
    body = {"prompt": "Keep going", "max_tokens": 40, "ignore_eos": True, "stream": stream}
    started = time.monotonic()
    r = await client.post(url, json=body)
    return r.status_code, time.monotonic() - started, r.headers, r.content


def test_burst_gets_503_at_once_and_the_rest_completes(server):
    rejected_before = server.metric("kiln:request_failure_total", reason="rejected")

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            url = server.base_url + "/v1/completions"
            return await asyncio.gather(*(timed_post(client, url, stream=i % 2 == 1) for i in range(10)))

    results = asyncio.run(burst())
    statuses = [status for status, *_ in results]
    assert set(statuses) <= {200, 503}
    assert statuses.count(200) >= 1 and statuses.count(503) >= 5
    for status, seconds, headers, content in results:
        if status == 503:
            assert headers["retry-after"].isdigit()
            assert b"overloaded" in content and b"max_queued_requests" in content
            assert seconds < 5.0
        else:
            assert b"length" in content
    assert server.metric("kiln:request_failure_total", reason="rejected") == rejected_before + statuses.count(503)


def test_serving_normally_after_the_burst(server):
    r = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
