"""If the engine process dies, in-flight requests get an error, /health turns
503 ("restarting"), new requests get 503 at once, and the server restarts the
engine and serves again (issue 17); with restarts used up it stays down, and
the server itself stays responsive throughout."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.integration.openai.live import kiln_server, start_inflight_requests


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    flags = ["--num-blocks", "64", "--served-model-name", "tiny", "--engine-restarts", "1",
             "--engine-restart-backoff-s", "1"]
    with kiln_server(tiny_llama_dir, *flags, tmp_dir=tmp_path_factory.mktemp("engine_death")) as s:
        yield s


def health(server) -> httpx.Response:
    return httpx.get(server.base_url + "/health", timeout=5)


def test_killing_the_engine_fails_requests_then_service_resumes(server):
    first_pid = server.engine_pid()
    inflight = start_inflight_requests(server.base_url, 30)
    os.kill(first_pid, signal.SIGKILL)
    inflight.join("the engine died")
    inflight.assert_failed_with_engine_dead()

    r = health(server)
    assert r.status_code == 503 and r.json() == {"status": "restarting", "models": {"tiny": "restarting"}}
    # Still live: the server restarts the engine itself, no orchestrator needs to.
    assert httpx.get(server.base_url + "/v2/health/live", timeout=5).status_code == 200
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_restarting_error"
    assert r.headers["retry-after"].isdigit()

    deadline = time.monotonic() + 120
    while health(server).status_code != 200:
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.2)
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert server.engine_pid() != first_pid
    assert server.metric("kiln:engine_restarts_total", model_name="tiny") == 1
    assert server.metric("kiln:request_failure_total", reason="engine_dead") == 2
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE


def test_with_no_restart_left_the_engine_stays_down(server):
    os.kill(server.engine_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while health(server).json()["models"]["tiny"] != "dead":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert health(server).status_code == 503
    # Not live either: an orchestrator's liveness probe restarts the process.
    assert httpx.get(server.base_url + "/v2/health/live", timeout=5).status_code == 503
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
    assert r.status_code == 503 and "died" in r.json()["error"]["message"]
    assert server.proc.poll() is None and not [c for c in psutil.Process(server.proc.pid).children()]
