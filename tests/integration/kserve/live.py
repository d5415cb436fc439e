"""Start `kiln serve --model-repository` in a subprocess for a test module."""
from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.integration.openai.live import free_port

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path
    ca: Path | None = None  # the server's certificate, when it serves TLS

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _url(self, path: str) -> str:
        return f"{'https' if self.ca else 'http'}://{self.http_url}{path}"

    def _verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else True

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self._url(path), timeout=30, verify=self._verify(), **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self._url(path), timeout=60, verify=self._verify(), **kw)

    def alive(self) -> bool:
        return self.proc.poll() is None and self.get("/v2/health/live").status_code == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def live_server(repo: Path, *args: str, timeout: float = 90.0, ca: Path | None = None):
    """`ca`: the certificate of --ssl-certfile, when `args` turn TLS on."""
    http_port, grpc_port = free_port(), free_port()
    log_path = Path(repo).parent / f"server-{http_port}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kiln.cli.main", "serve", "--model-repository", str(repo),
           "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = LiveServer(proc, http_port, grpc_port, log_path, ca)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if "loading" not in server.get("/health").json()["models"].values():
                    break  # every model loaded or failed: the server's start-up is over
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in {timeout}s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
