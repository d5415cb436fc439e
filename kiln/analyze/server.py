"""A `kiln serve` subprocess that the analyzer drives through its public API.

The server runs in a session of its own, so the Ctrl-C the user types at
the analyzer reaches the analyzer only: the analyzer finishes the point it
is measuring and then stops the server itself (SIGTERM, then SIGKILL to
its process group after a grace period, so no engine process is left).
Configurations are switched with the KServe model-control API (`POST
/v2/repository/models/NAME/load` with a `config` parameter), which builds
the new configuration completely before it replaces the old one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 600.0
LOAD_TIMEOUT_S = 600.0
# Memory has settled when it grew by less than this (or 1%) in one poll.
SETTLE_BYTES = 16 << 20
SETTLE_POLL_S = 1.0
SETTLE_TIMEOUT_S = 60.0


class LoadFailed(Exception):
    """The server could not serve a configuration (its message says why)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, serve_args: list[str], log_path: Path, grpc: bool = False):
        self.port = free_port()
        self.grpc_port = free_port() if grpc else -1
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kiln.cli.main", "serve", *serve_args, "--host", "127.0.0.1",
               "--port", str(self.port), "--grpc-port", str(self.grpc_port), "--log-level", "warning",
               "--model-control", "explicit"]  # the analyzer's own loopback server: configs switch by load
        self.command = cmd
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.client = httpx.Client(base_url=self.base_url, timeout=LOAD_TIMEOUT_S)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def wait_started(self, model: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `model` loaded (returns) or failed to (LoadFailed); RuntimeError if the server died."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                state = self.client.get("/health", timeout=5).json().get("models", {}).get(model)
                if state == "ready":
                    return
                if state not in (None, "loading"):
                    raise LoadFailed(self._reason(model) or f"model {model!r} is {state}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kiln serve did not load {model!r} in {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def _reason(self, model: str) -> str:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            for row in self.client.post("/v2/repository/index", json={}).json():
                if row.get("name") == model and row.get("reason"):
                    return str(row["reason"])
        return ""

    def load(self, model: str, config: dict) -> None:
        """Serve `config` for `model` (LoadFailed if the server refuses it; the old one keeps serving)."""
        response = self.client.post(f"/v2/repository/models/{model}/load",
                                    json={"parameters": {"config": json.dumps(config)}})
        if response.status_code != 200:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            raise LoadFailed(str(message)[:500])

    def settle_memory(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Until the server's resident memory stops growing: an LLM engine faults its KV pool
        in while idle after it starts, so a level measured at once read up to ~1 GiB less
        for the same configuration than one measured later (the memory column and plot)."""
        deadline = time.monotonic() + timeout_s
        last = self.resident_bytes()
        while time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
            now = self.resident_bytes()
            if now <= last + max(SETTLE_BYTES, last // 100):
                return
            last = now

    def resident_bytes(self) -> int:
        return int(sum(v for name, _, v in self.metrics() if name == "kiln:process_resident_memory_bytes"))

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample on /metrics: (name, labels, value)."""
        try:
            text = self.client.get("/metrics", timeout=30).text
        except httpx.HTTPError:
            return []
        return [(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]

    def stop(self, grace_s: float = 30.0) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # the server drains and stops its engines itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # engine processes left in the group, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
