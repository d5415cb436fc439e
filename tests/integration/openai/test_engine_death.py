"""If the engine process dies, in-flight requests get an error, /health turns
503, new requests get 503 at once, and the server itself stays responsive."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import psutil
import pytest

from tests.integration.openai.live import kiln_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with kiln_server(
        tiny_llama_dir,
        "--num-blocks",
        "64",
        "--served-model-name",
        "tiny",
        tmp_dir=tmp_path_factory.mktemp("engine_death"),
    ) as s:
        yield s


def test_killing_the_engine_fails_requests_and_health(server):
    streamed: list[str] = []
    whole: list[httpx.Response] = []
    started = threading.Event()
    body = {"prompt": "A very long answer", "max_tokens": 400, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    streamed.append(line[6:])
                    started.set()

    def wait_whole() -> None:
        whole.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=60))

    threads = [threading.Thread(target=stream), threading.Thread(target=wait_whole)]
    for t in threads:
        t.start()
    assert started.wait(30)
    os.kill(server.engine_pid(), signal.SIGKILL)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a request hung after the engine died"

    assert streamed[-1] == "[DONE]"
    assert json.loads(streamed[-2])["error"]["type"] == "engine_dead_error"
    assert whole[0].status_code == 503 and whole[0].json()["error"]["type"] == "engine_dead_error"

    health = httpx.get(server.base_url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["models"] == {"tiny": "dead"}
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
    assert r.status_code == 503 and "died" in r.json()["error"]["message"]
    assert server.metric("kiln:request_failure_total", reason="engine_dead") == 2
    assert server.proc.poll() is None and not [c for c in psutil.Process(server.proc.pid).children()]
