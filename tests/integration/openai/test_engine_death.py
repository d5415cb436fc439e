"""If the engine process dies, in-flight requests get an error, /health turns
503, new requests get 503 at once, and the server itself stays responsive."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest

from tests.integration.openai.live import kiln_server, start_inflight_requests


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
    inflight = start_inflight_requests(server.base_url, 30)
    os.kill(server.engine_pid(), signal.SIGKILL)
    inflight.join("the engine died")
    inflight.assert_failed_with_engine_dead()

    health = httpx.get(server.base_url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["models"] == {"tiny": "dead"}
    # Not live either: an orchestrator's liveness probe restarts the process.
    assert httpx.get(server.base_url + "/v2/health/live", timeout=5).status_code == 503
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
    assert r.status_code == 503 and "died" in r.json()["error"]["message"]
    assert server.metric("kiln:request_failure_total", reason="engine_dead") == 2
    assert server.proc.poll() is None and not [c for c in psutil.Process(server.proc.pid).children()]
