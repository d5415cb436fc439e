"""Run `kiln serve` in a subprocess on a free 127.0.0.1 port, for one test module."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class KilnServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers())
        return httpx.get(self.base_url + path, timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers())
        return httpx.post(self.base_url + path, timeout=120, **kw)

    def openai(self):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120
        )

    def engine_pid(self) -> int:
        children = psutil.Process(self.proc.pid).children()
        return next(c.pid for c in children if "core_proc" in " ".join(c.cmdline()))

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value from /metrics, parsed with prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        raise KeyError(name)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_healthy(server: KilnServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {server.proc.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"kiln serve not healthy after {timeout}s:\n{server.log()}")
        time.sleep(0.2)


def stop(server: KilnServer) -> None:
    """SIGTERM, then SIGKILL; and make sure no engine process is left behind."""
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def kiln_server(
    model: str | Path | None, *args: str, tmp_dir: Path, api_key: str | None = None, timeout: float = 180.0
) -> Iterator[KilnServer]:
    port = free_port()
    log_path = Path(tmp_dir) / f"kiln-serve-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KILN_LOG_LEVEL": "WARNING"}
    env.pop("KILN_API_KEY", None)
    cmd = [
        sys.executable,
        "-m",
        "kiln.cli.main",
        "serve",
        *([str(model)] if model else []),
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = KilnServer(proc, port, log_path, api_key)
    try:
        wait_healthy(server, timeout)
        yield server
    finally:
        stop(server)


@dataclass
class InflightRequests:
    """A streamed and a non-streamed long completion, running in threads."""

    threads: list[threading.Thread]
    streamed: list[str]  # SSE data payloads so far
    whole: list[httpx.Response]  # the non-streamed response, once it came

    def join(self, what: str, timeout: float = 30) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), f"a request hung after {what}"

    def assert_failed_with_engine_dead(self) -> None:
        assert self.streamed[-1] == "[DONE]"
        assert json.loads(self.streamed[-2])["error"]["type"] == "engine_dead_error"
        assert self.whole[0].status_code == 503 and self.whole[0].json()["error"]["type"] == "engine_dead_error"


def start_inflight_requests(base_url: str, started_timeout: float) -> InflightRequests:
    """Start both requests; return once the stream has produced a token."""
    body = {"prompt": "A very long answer", "max_tokens": 400, "ignore_eos": True}
    started = threading.Event()
    requests = InflightRequests([], [], [])

    def stream() -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    requests.streamed.append(line[6:])
                    started.set()

    def wait_whole() -> None:
        requests.whole.append(httpx.post(base_url + "/v1/completions", json=body, timeout=60))

    requests.threads = [threading.Thread(target=stream), threading.Thread(target=wait_whole)]
    for t in requests.threads:
        t.start()
    assert started.wait(started_timeout)
    # The stream's first token does not mean the other request reached the engine: on a loaded machine
    # its POST can still be on the way, and a kill then answers it 503 "restarting" instead of "dead".
    deadline = time.monotonic() + started_timeout
    while _requests_in_engine(base_url) < 2:
        assert not requests.whole, "the non-streamed request finished before both were in the engine"
        assert time.monotonic() < deadline, "the two requests were not both in the engine"
        time.sleep(0.01)
    return requests


def _requests_in_engine(base_url: str) -> float:
    """Running plus waiting requests over every model, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name in ("kiln:num_requests_running", "kiln:num_requests_waiting"))
