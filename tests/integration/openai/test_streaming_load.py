"""Concurrency, client disconnects and metrics on one live server (tiny model)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.openai.live import kiln_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with kiln_server(
        tiny_llama_dir,
        "--num-blocks",
        "512",
        "--served-model-name",
        "tiny",
        tmp_dir=tmp_path_factory.mktemp("streaming"),
    ) as s:
        yield s


def sse_data(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


async def stream_one(client: httpx.AsyncClient, url: str, i: int) -> list[str]:
    body = {
        "model": "tiny",
        "prompt": f"Request number {i} says",
        "max_tokens": 5 + i % 7,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
    }
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_data([line async for line in resp.aiter_lines()])


def test_32_concurrent_streams_complete_exactly(server):
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(stream_one(client, server.base_url + "/v1/completions", i) for i in range(32))
            )

    for i, events in enumerate(asyncio.run(run())):
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == []
        token_chunks = [c for c in chunks[:-1]]
        terminal = [c for c in token_chunks if c["choices"][0]["finish_reason"] is not None]
        assert len(terminal) == 1 and terminal[0] is token_chunks[-1]
        assert terminal[0]["choices"][0]["finish_reason"] == "length"
        streamed_tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in token_chunks)
        assert streamed_tokens == usage_chunk["usage"]["completion_tokens"] == 5 + i % 7


def wait_idle(server, timeout: float = 10.0) -> float:
    """Seconds until the engine holds no request and no KV block."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if server.metric("kiln:kv_cache_usage_perc") == 0 and server.metric("kiln:num_requests_running") == 0:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"KV cache still in use after {timeout}s: {server.metric('kiln:kv_cache_usage_perc')}")


def aborts(server) -> float:
    return server.metric("kiln:request_failure_total", reason="abort")


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    wait_idle(server)
    before = aborts(server)
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", server.base_url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line.startswith("data: "))
        # Still connected: the request holds KV blocks. (Leaving iter_lines early closes the connection.)
        assert server.metric("kiln:kv_cache_usage_perc") > 0
        assert server.metric("kiln:num_requests_running") == 1
    wait_idle(server)
    assert aborts(server) == before + 1


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server):
    wait_idle(server)
    before = aborts(server)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", timeout=0.5, json=body)
    wait_idle(server)
    assert aborts(server) == before + 1
    assert server.get("/health").status_code == 200


REQUIRED = [
    "kiln:num_requests_running",
    "kiln:num_requests_waiting",
    "kiln:kv_cache_usage_perc",
    "kiln:prefix_cache_queries",
    "kiln:prefix_cache_hits",
    "kiln:num_preemptions",
    "kiln:prompt_tokens",
    "kiln:generation_tokens",
    "kiln:request_success",
    "kiln:request_failure",
    "kiln:time_to_first_token_seconds",
    "kiln:time_per_output_token_seconds",
    "kiln:inter_token_latency_seconds",
    "kiln:e2e_request_latency_seconds",
    "kiln:request_queue_time_seconds",
    "kiln:batch_size",
    "kiln:step_duration_seconds",
    "kiln:process_cpu_seconds",
    "kiln:process_resident_memory_bytes",
]


def test_metrics_parse_and_move(server):
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    assert set(REQUIRED) <= set(families), set(REQUIRED) - set(families)
    for name in REQUIRED:
        assert all(s.labels.get("model_name") == "tiny" for s in families[name].samples), name
    processes = {s.labels["process"] for s in families["kiln:process_resident_memory_bytes"].samples}
    assert processes == {"api", "engine"}

    def snapshot():
        return {
            "ok": server.metric("kiln:request_success_total", finished_reason="length"),
            "gen": server.metric("kiln:generation_tokens_total"),
            "prompt": server.metric("kiln:prompt_tokens_total"),
            "ttft": server.metric("kiln:time_to_first_token_seconds_count"),
            "e2e": server.metric("kiln:e2e_request_latency_seconds_count"),
            "queries": server.metric("kiln:prefix_cache_queries_total"),
            "steps": server.metric("kiln:step_duration_seconds_count"),
        }

    before = snapshot()
    out = server.post("/v1/completions", json={"prompt": "Metrics please", "max_tokens": 7, "ignore_eos": True}).json()
    after = snapshot()
    assert after["ok"] == before["ok"] + 1
    assert after["gen"] == before["gen"] + 7
    assert after["prompt"] == before["prompt"] + out["usage"]["prompt_tokens"]
    assert after["ttft"] == before["ttft"] + 1 and after["e2e"] == before["e2e"] + 1
    assert after["queries"] > before["queries"] and after["steps"] >= before["steps"] + 7
