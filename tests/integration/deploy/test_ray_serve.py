"""Kiln on a local Ray Serve cluster: replicas of a tiny random-weight LLM
behind Ray's HTTP proxy.

One module, one cluster, in order: the routes answer through the proxy
(OpenAI, streaming, KServe v2, health, metrics); a bounded burst scales the
replicas from 1 to the maximum and, once it ends, back to 1 while a client
keeps sending, with every request answered in full (none lost); a replica
killed with SIGKILL fails its in-flight requests promptly (no hang) and is
replaced. The figures (replicas over time) go to RAY_BURST_REPORT when set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
import yaml

from kiln.config import EngineConfig, ServerConfig
from tests.integration.openai.live import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = [
    pytest.mark.ray,
    pytest.mark.timeout(600),
    # Ray deprecates metrics_interval_s (default 10 s) yet warns when look_back_period_s is shorter.
    pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning"),
]

APP = "kiln"
MAX_REPLICAS = 3
MAX_TOKENS = 32
RAY_ENV = {
    # how often replicas and handles report load to Ray's autoscaler
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_USAGE_STATS_ENABLED": "0",  # the test cluster sends nothing off this machine
}


DOUBLE_PY = """
from kiln.serving.model import Model

class Double(Model):
    def execute(self, requests):
        return [{"OUT": r.inputs["IN"] * 2} for r in requests]
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """A model repository with one python model, served beside the LLM."""
    root = tmp_path_factory.mktemp("repo")
    (root / "double" / "1").mkdir(parents=True)
    (root / "double" / "1" / "model.py").write_text(DOUBLE_PY)
    (root / "double" / "config.yaml").write_text(yaml.safe_dump({
        "backend": "python", "max_batch_size": 4,
        "inputs": [{"name": "IN", "datatype": "FP32", "dims": [2]}],
        "outputs": [{"name": "OUT", "datatype": "FP32", "dims": [2]}],
    }))
    return root


@pytest.fixture(scope="module")
def proxy(tiny_llama_dir, repository):
    """The Serve proxy's URL, with the Kiln application deployed (1 replica)."""
    from kiln.deploy.ray_config import RayServeConfig
    from kiln.deploy.ray_serve import application

    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    ray.init(num_cpus=MAX_REPLICAS, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **RAY_ENV}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        server = ServerConfig(served_model_name="tiny", model_repository=str(repository), shutdown_timeout=20,
                              autoscale_target_requests=2)
        llm = EngineConfig.from_flat(model=str(tiny_llama_dir), kv_cache_memory_gib=0.02, max_model_len=512)
        scaling = RayServeConfig(ray_min_replicas=1, ray_max_replicas=MAX_REPLICAS, ray_upscale_delay_s=1.0,
                                 ray_downscale_delay_s=3.0, ray_look_back_period_s=2.0, ray_max_ongoing_requests=4)
        serve.run(application(server, llm, scaling), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments["kiln"]
    return status.replica_states.get("RUNNING", 0)


def complete(client: httpx.Client, url: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return client.post(f"{url}/v1/completions", json=body)


def test_routes_answer_through_the_proxy(proxy):
    with httpx.Client(timeout=60) as client:
        assert client.get(f"{proxy}/health").json()["models"] == {"tiny": "ready", "double": "ready"}
        tensor = {"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2.0]}
        doubled = client.post(f"{proxy}/v2/models/double/infer", json={"inputs": [tensor]})
        assert doubled.status_code == 200 and doubled.json()["outputs"][0]["data"] == [3.0, -4.0]
        r = complete(client, proxy, max_tokens=8)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert r.headers["x-kiln-replica"]
        body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]},
                           {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [8]}]}
        v2 = client.post(f"{proxy}/v2/models/tiny/infer", json=body)
        assert v2.status_code == 200 and v2.json()["outputs"][0]["data"] == [r.json()["choices"][0]["text"]]
        events = []
        stream_body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True}
        with client.stream("POST", f"{proxy}/v1/completions", json=stream_body) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 3  # streamed chunk by chunk
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert text == r.json()["choices"][0]["text"]
        assert "kiln:desired_replicas" in client.get(f"{proxy}/metrics").text


@dataclass
class Load:
    """Clients sending completions in a loop; every answer checked."""

    url: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    replicas_seen: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, stop: threading.Event) -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                r = complete(client, self.url)
                body = r.json() if r.status_code == 200 else {}
                complete_answer = body.get("usage", {}).get("completion_tokens") == MAX_TOKENS
                with self.lock:
                    if complete_answer and body["choices"][0]["finish_reason"] == "length":
                        self.ok += 1
                        self.replicas_seen.add(r.headers["x-kiln-replica"])
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")

    def start(self, clients: int) -> tuple[threading.Event, list[threading.Thread]]:
        stop = threading.Event()
        threads = [threading.Thread(target=self.client, args=(stop,), daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        return stop, threads


def wait_for(condition, timeout: float, samples: list, t0: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples.append((round(time.monotonic() - t0, 1), running_replicas()))
        if condition(samples[-1][1]):
            return True
        time.sleep(0.5)
    return False


def test_a_burst_scales_out_and_back_in_losing_nothing(proxy):
    assert running_replicas() == 1
    load, samples, t0 = Load(proxy), [], time.monotonic()
    burst, burst_threads = load.start(clients=12)
    trickle, trickle_threads = load.start(clients=1)
    reached_max = wait_for(lambda n: n >= MAX_REPLICAS, 120, samples, t0)
    time.sleep(3)  # the maximum serves a while
    burst.set()
    for thread in burst_threads:
        thread.join(timeout=120)
    burst_end = round(time.monotonic() - t0, 1)
    back_to_one = wait_for(lambda n: n == 1, 120, samples, t0)  # the trickle goes on during scale-in
    time.sleep(2)
    trickle.set()
    for thread in trickle_threads:
        thread.join(timeout=120)
    report = {"samples": samples, "burst_end_s": burst_end, "ok": load.ok, "lost": len(load.failures),
              "replicas_seen": len(load.replicas_seen)}
    if os.environ.get("RAY_BURST_REPORT"):
        with open(os.environ["RAY_BURST_REPORT"], "w") as f:
            json.dump(report, f)
    assert reached_max, report
    assert back_to_one, report
    assert load.failures == [], report
    assert len(load.replicas_seen) >= 2, report  # more than one replica answered
    assert load.ok > 0


def replica_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if cmdline.startswith(f"ray::ServeReplica:{APP}:kiln"):
            found.append(proc)
    return found


def test_a_killed_replica_fails_its_requests_and_is_replaced(proxy):
    assert running_replicas() == 1
    deadline = time.monotonic() + 60
    while len(replica_processes()) > 1 and time.monotonic() < deadline:
        time.sleep(0.5)  # replicas stopped by the scale-in exit once drained
    (victim,) = replica_processes()
    outcomes: list[str] = []

    def stream() -> None:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "temperature": 0, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as client, \
                    client.stream("POST", f"{proxy}/v1/completions", json=body) as s:
                lines = list(s.iter_lines())
                outcomes.append("complete" if s.status_code == 200 and lines[-1] == "data: [DONE]" else "error")
        except httpx.HTTPError as e:
            outcomes.append(f"error: {type(e).__name__}")

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the streams are running
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "an in-flight request hung after its replica died"
    assert time.monotonic() - killed_at < 60
    assert len(outcomes) == 3 and all(o.startswith("error") for o in outcomes), outcomes
    # Ray's controller notices the dead replica and starts another; it serves.
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < deadline:
            try:
                r = complete(client, proxy, max_tokens=4)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert [p.pid for p in replica_processes()] != [victim.pid]


def test_kiln_serve_ray_deploys_and_drains_on_sigterm(proxy, tiny_llama_dir, tmp_path):
    """The CLI path: `kiln serve --ray` joins the running cluster, serves its own application
    under a route prefix, and on SIGTERM deletes it (replicas drain) and exits 0."""
    address = ray.get_runtime_context().gcs_address
    log = tmp_path / "kiln-ray.log"
    command = [sys.executable, "-m", "kiln.cli.main", "serve", str(tiny_llama_dir), "--served-model-name", "cli",
               "--kv-cache-memory-gib", "0.02", "--max-model-len", "128", "--ray", "--ray-address", address,
               "--ray-app-name", "cli", "--ray-route-prefix", "/cli", "--ray-max-replicas", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, answer = time.monotonic() + 180, None
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    body = {"model": "cli", "prompt": "Hi", "max_tokens": 3}
                    r = client.post(f"{proxy}/cli/v1/completions", json=body)
                    if r.status_code == 200:
                        answer = r.json()
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
        assert answer is not None and answer["usage"]["completion_tokens"] == 3, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert "cli" not in serve.status().applications
        assert APP in serve.status().applications  # the other application serves on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
