"""KServe v2 over HTTP, side by side: Kiln (no batching, dynamic batching) and
MLServer (no batching, adaptive batching) on the tabular ONNX model, one row
per request, JSON tensors, the same client and run.

    .venv/bin/python bench/http_infer.py [--duration 4] [--rounds 2] [--levels 1,8,32]
        [--mlserver-venv bench/peers/envs/mlserver]   # python3.11 -m venv ...; pip install mlserver onnxruntime

Both servers run at once, each in its own process; for every round and
concurrency level the four targets run back to back, in an order that
alternates between rounds, so a ratio compares figures of the same moment.
The client is a small keep-alive HTTP/1.1 client on raw asyncio streams (a
pre-built request, the response read by Content-Length), so that its own
cost, shared with the servers on this machine, stays low and equal for all.

Kiln: `intra_op_num_threads: 1`; batching `max_queue_delay_ms: 2`,
`preferred_batch_sizes: [16, 32]`. MLServer 1.x: the onnxruntime runtime of
bench/peers/mlserver/runtime.py (same session options), `parallel_workers: 0`
(inference in the server process, its fastest setting for a cheap model),
`debug: false` (no access log, as Kiln); batching `max_batch_size: 64`,
`max_batch_time: 0.002`. Without --mlserver-venv (or when it is missing) only
Kiln runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "tabular"))

from build_repository import build, train  # noqa: E402

KILN_BATCHED, KILN_PLAIN = "breast_cancer", "breast_cancer_nobatch"


# ---------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln_repository(root: Path) -> Path:
    repo = build(root / "kiln")
    plain = repo / KILN_PLAIN
    (plain / "1").mkdir(parents=True)
    shutil.copyfile(repo / KILN_BATCHED / "1" / "model.onnx", plain / "1" / "model.onnx")
    (plain / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 64\n"
                                       "parameters:\n  intra_op_num_threads: 1\n")
    return repo


def mlserver_repository(root: Path, model_path: Path, http_port: int) -> Path:
    repo = root / "mlserver"
    for name, batching in ((KILN_BATCHED, {"max_batch_size": 64, "max_batch_time": 0.002}), (KILN_PLAIN, {})):
        (repo / name).mkdir(parents=True)
        shutil.copyfile(ROOT / "bench" / "peers" / "mlserver" / "runtime.py", repo / name / "runtime.py")
        settings = {"name": name, "implementation": "runtime.OnnxRuntime", **batching,
                    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 30]}],
                    "parameters": {"uri": str(model_path)}}
        (repo / name / "model-settings.json").write_text(json.dumps(settings))
    (repo / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": http_port, "grpc_port": free_port(), "metrics_port": free_port(),
        "parallel_workers": 0, "debug": False}))
    return repo


def start(command: list[str], cwd: Path, log: Path, source: Path = ROOT) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(source)})


def start_kiln(repo: Path, port: int, log: Path, source: Path = ROOT) -> subprocess.Popen:
    return start([sys.executable, "-m", "kiln.cli.main", "serve", "--model-repository", str(repo),
                  "--port", str(port), "--grpc-port", "-1", "--log-level", "warning"], source, log, source)


def wait_ready(port: int, models: list[str], proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if all(httpx.get(f"http://127.0.0.1:{port}/v2/models/{m}/ready", timeout=1).status_code == 200
                   for m in models):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server on port {port} not ready after {timeout_s} s:\n{log.read_text()[-2000:]}")


# ---------------------------------------------------------------- client

def infer_request(port: int, model: str, row: np.ndarray) -> bytes:
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, row.size], "datatype": "FP32",
                                   "data": row.ravel().tolist()}]}).encode()
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bytes:
    """One request on a keep-alive connection; the response body (status 200 or an error)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = head[9:12]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length)
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {body[:200]!r}")
    return body


@dataclass
class Level:
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.elapsed_s

    def ms(self, q: float) -> float:
        return float(np.percentile(np.array(self.latencies_s) * 1000, q))


async def run_level(port: int, request: bytes, concurrency: int, duration_s: float) -> Level:
    level = Level()
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]
    for reader, writer in connections:  # warm each connection
        await exchange(reader, writer, request)
    deadline = time.perf_counter() + duration_s

    async def worker(reader, writer):
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await exchange(reader, writer, request)
            level.latencies_s.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker(r, w) for r, w in connections))
    level.elapsed_s = time.perf_counter() - start
    for _, writer in connections:
        writer.close()
    return level


async def check_same_answer(targets: dict[str, tuple[int, bytes]]) -> None:
    """Every target answers the same probabilities for the benchmark row."""
    answers = {}
    for label, (port, request) in targets.items():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        doc = json.loads(await exchange(reader, writer, request))
        writer.close()
        answers[label] = {o["name"]: np.asarray(o["data"], np.float64) for o in doc["outputs"]}
    first = next(iter(answers.values()))
    for label, outputs in answers.items():
        for name, value in first.items():
            if not np.allclose(outputs[name], value, atol=1e-6):
                raise RuntimeError(f"{label} answers {name}={outputs[name]}, expected {value}")


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per target and level")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--mlserver-venv", default=str(ROOT / "bench" / "peers" / "envs" / "mlserver"))
    parser.add_argument("--kiln-baseline", type=Path,
                        help="also run Kiln from this source tree (e.g. `git archive main | tar -x -C DIR`)")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    mlserver = Path(args.mlserver_venv) / "bin" / "mlserver"
    _, x, _ = train()
    row = x[:1]
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        repo = kiln_repository(root)
        kiln_port = free_port()
        kiln_log = root / "kiln.log"
        procs.append(start_kiln(repo, kiln_port, kiln_log))
        targets = {"Kiln, no batching": (kiln_port, infer_request(kiln_port, KILN_PLAIN, row)),
                   "Kiln, dynamic batching": (kiln_port, infer_request(kiln_port, KILN_BATCHED, row))}
        try:
            if args.kiln_baseline:
                base_port, base_log = free_port(), root / "kiln-baseline.log"
                procs.append(start_kiln(repo, base_port, base_log, args.kiln_baseline.resolve()))
                targets["Kiln baseline, no batching"] = (base_port, infer_request(base_port, KILN_PLAIN, row))
                targets["Kiln baseline, dynamic batching"] = (base_port, infer_request(base_port, KILN_BATCHED, row))
                wait_ready(base_port, [KILN_PLAIN, KILN_BATCHED], procs[-1], base_log)
            if mlserver.exists():
                ml_port = free_port()
                ml_repo = mlserver_repository(root, repo / KILN_BATCHED / "1" / "model.onnx", ml_port)
                ml_log = root / "mlserver.log"
                procs.append(start([str(mlserver), "start", str(ml_repo)], ml_repo, ml_log))
                targets["MLServer, no batching"] = (ml_port, infer_request(ml_port, KILN_PLAIN, row))
                targets["MLServer, adaptive batching"] = (ml_port, infer_request(ml_port, KILN_BATCHED, row))
                wait_ready(ml_port, [KILN_PLAIN, KILN_BATCHED], procs[-1], ml_log)
            else:
                print(f"({mlserver} not found: Kiln only)")
            wait_ready(kiln_port, [KILN_PLAIN, KILN_BATCHED], procs[0], kiln_log)
            asyncio.run(check_same_answer(targets))
            results = asyncio.run(sweep(targets, levels, args.duration, args.rounds))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
    report(results, levels, args)


async def sweep(targets, levels, duration_s, rounds) -> dict[tuple[str, int], list[Level]]:
    results: dict[tuple[str, int], list[Level]] = {}
    labels = list(targets)
    for r in range(rounds):
        for level in levels:
            for label in (labels if r % 2 == 0 else labels[::-1]):
                port, request = targets[label]
                results.setdefault((label, level), []).append(await run_level(port, request, level, duration_s))
    return results


def report(results, levels, args) -> None:
    labels = list(dict.fromkeys(label for label, _ in results))
    load = os.getloadavg()[0]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f}; "
          f"{args.rounds} rounds x {args.duration:.0f} s per target and level; one row per request, JSON tensors\n")
    print("requests/s, median of the rounds (p50 / p99 ms of the round with the median requests/s):\n")
    print("| target | " + " | ".join(f"c={c}" for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for label in labels:
        cells = []
        for c in levels:
            runs = sorted(results[(label, c)], key=lambda lv: lv.rps)
            mid = runs[len(runs) // 2]
            cells.append(f"{statistics.median(lv.rps for lv in runs):.0f} ({mid.ms(50):.2f} / {mid.ms(99):.2f})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nratios per round (same round, same level):\n")
    pairs = [("Kiln, dynamic batching", "Kiln, no batching")]
    if "Kiln baseline, no batching" in labels:
        pairs += [("Kiln, no batching", "Kiln baseline, no batching"),
                  ("Kiln, dynamic batching", "Kiln baseline, dynamic batching")]
    if "MLServer, no batching" in labels:
        pairs += [("Kiln, no batching", "MLServer, no batching"),
                  ("Kiln, dynamic batching", "MLServer, adaptive batching"),
                  ("Kiln best", "MLServer best")]
    print("| ratio | " + " | ".join(f"c={c}" for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for a, b in pairs:
        cells = []
        for c in levels:
            ratios = [_rps(results, a, c, r) / _rps(results, b, c, r) for r in range(len(results[(labels[0], c)]))]
            cells.append(" / ".join(f"{v:.2f}" for v in ratios))
        print(f"| {a} / {b} | " + " | ".join(cells) + " |")


def _rps(results, label: str, c: int, r: int) -> float:
    if label.endswith(" best"):
        server = label.removesuffix(" best")
        return max(lv[r].rps for (name, level), lv in results.items()
                   if level == c and name.startswith(server + ","))
    return results[(label, c)][r].rps


if __name__ == "__main__":
    main()
