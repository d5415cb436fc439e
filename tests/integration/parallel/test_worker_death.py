"""A parallel worker that dies fails the engine cleanly, never a hang.

In-process (offline LLM): mid-generation and while idle, the next step
raises EngineDeadError naming the worker. Server: in-flight requests get an
engine_dead_error, /health turns 503, and no process is left behind.
"""
from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from kiln import LLM, SamplingParams
from kiln.errors import EngineDeadError
from tests.integration.openai.live import kiln_server, start_inflight_requests
from tests.integration.parallel.conftest import wait_no_workers, worker_processes

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def test_worker_killed_mid_generation_raises(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_blocks=64, tensor_parallel_size=2)
    try:
        engine = llm.engine
        for i in range(4):
            engine.add_request(f"r{i}", [5, 6, 7, 8, 9], LONG)
        for _ in range(3):
            engine.step()
        os.kill(engine.core.runner.worker_pids[0], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank 1|collective failed"):
            while time.monotonic() - started < 30:
                engine.step()
        assert time.monotonic() - started < 30
    finally:
        llm.shutdown()


def test_worker_killed_while_idle_fails_next_request(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), num_blocks=64, pipeline_parallel_size=2) as llm:
        pid = llm.engine.core.runner.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.core.runner.dead_message is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(EngineDeadError, match=f"pid {pid}"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with kiln_server(
        tiny_llama_dir,
        "--num-blocks",
        "64",
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "2",
        # No restart: this module checks the death itself (restarts: openai/test_engine_death.py).
        "--engine-restarts",
        "0",
        tmp_dir=tmp_path_factory.mktemp("worker_death"),
    ) as s:
        yield s


def test_server_worker_death_fails_requests_and_health(server):
    inflight = start_inflight_requests(server.base_url, 60)
    workers = worker_processes()
    assert len(workers) == 1
    workers[0].kill()
    inflight.join("a worker died")
    inflight.assert_failed_with_engine_dead()
    health = httpx.get(server.base_url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["models"] == {"tiny": "dead"}
    # The engine process stopped its other ranks and exited; the server lives on.
    assert not wait_no_workers()
    deadline = time.monotonic() + 15
    while psutil.Process(server.proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.poll() is None and not psutil.Process(server.proc.pid).children()
