"""Server overhead and batching gain for the tabular model (not a test).

Runs the skl2onnx breast-cancer classifier three ways, one row per request,
at concurrency 1, 8 and 32:
  1. directly with onnxruntime in this process (threads calling session.run);
  2. through Kiln without dynamic batching;
  3. through Kiln with dynamic batching;
over HTTP (binary tensors) and gRPC, and prints a markdown section.

    .venv/bin/python examples/tabular/bench_overhead.py [--duration 3]

Client and server share this machine's cores, so the client's own cost is
part of every "through Kiln" figure.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_repository import build, train  # noqa: E402

from kiln.bench.infer import sweep  # noqa: E402

LEVELS = (1, 8, 32)


def direct(model_path: Path, x: np.ndarray, duration: float) -> list[dict]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    rows = [x[i:i + 1] for i in range(len(x))]
    results = []
    for level in LEVELS:
        latencies: list[list[float]] = [[] for _ in range(level)]
        deadline = time.perf_counter() + duration

        def worker(i, deadline=deadline, latencies=latencies):
            n = 0
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                session.run(None, {"input": rows[n % len(rows)]})
                latencies[i].append(time.perf_counter() - start)
                n += 1

        start = time.perf_counter()
        with ThreadPoolExecutor(level) as pool:
            list(pool.map(worker, range(level)))
        elapsed = time.perf_counter() - start
        flat = np.array([v for lat in latencies for v in lat]) * 1000
        results.append({"concurrency": level, "throughput_rps": len(flat) / elapsed,
                        "p50_ms": float(np.percentile(flat, 50)), "p99_ms": float(np.percentile(flat, 99))})
    return results


def make_repository(root: Path) -> Path:
    repo = build(root / "repo")
    nobatch = repo / "breast_cancer_nobatch"
    (nobatch / "1").mkdir(parents=True)
    shutil.copyfile(repo / "breast_cancer" / "1" / "model.onnx", nobatch / "1" / "model.onnx")
    (nobatch / "config.yaml").write_text(
        "backend: onnxruntime\nmax_batch_size: 64\nparameters:\n  intra_op_num_threads: 1\n")
    return repo


def start_server(repo: Path, http_port: int, grpc_port: int) -> subprocess.Popen:
    import httpx

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", "--model-repository", str(repo),
                             "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning"],
                            env=env, cwd=ROOT)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not become ready")


async def _null_call_ms(protocol: str, url: str, n: int = 300) -> float:
    """p50 of a call that does no inference (health), through the same client:
    the transport + client cost that every request pays."""
    if protocol == "http":
        import httpx

        async with httpx.AsyncClient(base_url=f"http://{url}") as client:
            call = lambda: client.get("/v2/health/live")  # noqa: E731
            return await _p50(call, n)
    import grpc

    from kiln.frontends.kserve.grpc.stubs import load_stubs

    pb2, pb2_grpc = load_stubs()
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb2_grpc.GRPCInferenceServiceStub(channel)
        return await _p50(lambda: stub.ServerLive(pb2.ServerLiveRequest()), n)


async def _p50(call, n: int) -> float:
    await call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 50) * 1000)


def _row(label: str, results: list[dict]) -> str:
    cells = " | ".join(f"{r['throughput_rps']:.0f} / {r['p50_ms']:.2f} / {r['p99_ms']:.2f}" for r in results)
    return f"| {label} | {cells} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=3.0)
    args = parser.parse_args()
    _, x, _ = train()
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repository(Path(tmp))
        base = direct(repo / "breast_cancer" / "1" / "model.onnx", x, args.duration)
        proc = start_server(repo, 18700, 18701)
        try:
            runs, null_ms = {}, {}
            for protocol, url in (("http", "127.0.0.1:18700"), ("grpc", "127.0.0.1:18701")):
                null_ms[protocol] = asyncio.run(_null_call_ms(protocol, url))
                for model in ("breast_cancer_nobatch", "breast_cancer"):
                    runs[(protocol, model)] = asyncio.run(sweep(protocol, url, model, list(LEVELS), args.duration))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"Machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}; {args.duration:.0f} s per level; one row per request.\n")
    print("| path | c=1: req/s / p50 ms / p99 ms | c=8 | c=32 |")
    print("|---|---|---|---|")
    print(_row("onnxruntime in-process", base))
    for (protocol, model), results in runs.items():
        label = f"Kiln {protocol}, {'dynamic batching' if model == 'breast_cancer' else 'no batching'}"
        print(_row(label, results))
    print()
    for protocol in ("http", "grpc"):
        overhead = runs[(protocol, "breast_cancer_nobatch")][0]["p50_ms"] - base[0]["p50_ms"]
        batched, plain = runs[(protocol, "breast_cancer")], runs[(protocol, "breast_cancer_nobatch")]
        gain = batched[2]["throughput_rps"] / plain[2]["throughput_rps"]
        print(f"- {protocol}: overhead per request at c=1 (p50, Kiln no batching minus in-process) = "
              f"{overhead:.2f} ms, of which {null_ms[protocol]:.2f} ms is the transport + client round trip "
              f"(p50 of a health call); batching gain at c=32 = {gain:.2f}x requests/s")


if __name__ == "__main__":
    main()
