"""Driving a server at one load level with Kiln's own load generators.

Repository models: `kiln bench infer`'s closed loop (a concurrency of
workers sending back to back for `duration_s`) over KServe v2 HTTP or gRPC.
LLMs: `kiln bench serve`'s open loop (Poisson arrivals at a request rate)
of streamed completions, `rate * duration_s` requests (at least
`min_requests`). After the level, the server's /metrics give its memory and,
with a price, its own cost gauge.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from kiln.analyze.objective import Point
from kiln.analyze.server import ServerProcess
from kiln.bench.client import Target
from kiln.bench.dataset import synthetic
from kiln.bench.infer import GrpcTarget, HttpTarget, make_inputs, run_level
from kiln.bench.report import summarize
from kiln.bench.runner import LoadShape, run_load


@dataclass(frozen=True)
class Workload:
    kind: str  # "repository" (levels are concurrencies) or "llm" (levels are request rates)
    levels: tuple[float, ...]
    duration_s: float = 5.0
    # repository models
    protocol: str = "http"
    batch_size: int = 1
    dim: int = 1
    warmup: int = 5
    # LLMs
    input_len: int = 128
    output_len: int = 64
    dataset: str = "text"
    min_requests: int = 8
    seed: int = 0

    def describe(self) -> dict:
        out = {"levels": list(self.levels), "duration_s": self.duration_s, "seed": self.seed}
        if self.kind == "llm":
            out.update(input_len=self.input_len, output_len=self.output_len, dataset=self.dataset,
                       min_requests=self.min_requests)
        else:
            out.update(protocol=self.protocol, batch_size=self.batch_size, dim=self.dim)
        return out


def measure_level(server: ServerProcess, model: str, workload: Workload, level: float, price: float | None) -> Point:
    if workload.kind == "llm":
        point = asyncio.run(_llm_level(server, model, workload, level))
    else:
        point = asyncio.run(_repository_level(server, model, workload, int(level)))
    _add_server_metrics(point, server.metrics(), model)
    return point


async def _repository_level(server: ServerProcess, model: str, workload: Workload, concurrency: int) -> Point:
    if workload.protocol == "grpc":
        target: HttpTarget | GrpcTarget = GrpcTarget(f"127.0.0.1:{server.grpc_port}", model)
    else:
        target = HttpTarget(server.base_url, model)
    try:
        metadata = await target.metadata()
        prepared = target.prepare(make_inputs(metadata, workload.batch_size, workload.dim, workload.seed))
        for _ in range(workload.warmup):
            await target.infer(prepared)
        summary = (await run_level(target, prepared, concurrency, workload.duration_s, workload.batch_size)).summary()
    finally:
        await target.close()
    return Point(
        level=float(concurrency), duration_s=workload.duration_s, requests=summary["requests"],
        errors=summary["errors"], throughput_rps=summary["throughput_rps"],
        inferences_per_s=summary["inferences_per_s"], p50_ms=summary["p50_ms"], p90_ms=summary["p90_ms"],
        p99_ms=summary["p99_ms"], first_error=summary["first_error"],
    )


async def _llm_level(server: ServerProcess, model: str, workload: Workload, rate: float) -> Point:
    count = max(workload.min_requests, math.ceil(rate * workload.duration_s))
    items = synthetic(workload.dataset, count, workload.input_len, workload.output_len, 0.0, workload.seed)
    target = Target(server.base_url, model, "completions")
    results, duration = await run_load(target, items, LoadShape(rate, None, workload.seed), timeout_s=600.0)
    summary = summarize(results, duration, {})
    return Point(
        level=rate, duration_s=duration, requests=summary["completed"], errors=summary["failed"],
        throughput_rps=summary["request_throughput"], output_tokens_per_s=summary["output_throughput"],
        p50_ms=summary["e2el_ms"]["p50"], p90_ms=summary["e2el_ms"]["p90"], p99_ms=summary["e2el_ms"]["p99"],
        ttft_p50_ms=summary["ttft_ms"]["p50"], ttft_p99_ms=summary["ttft_ms"]["p99"],
        tpot_p50_ms=summary["tpot_ms"]["p50"], tpot_p99_ms=summary["tpot_ms"]["p99"],
        first_error="; ".join(summary["errors"])[:300],
    )


def _add_server_metrics(point: Point, samples: list[tuple[str, dict[str, str], float]], model: str) -> None:
    rss = [v for name, _, v in samples if name == "kiln:process_resident_memory_bytes"]
    point.memory_bytes = int(sum(rss)) if rss else None
    held = [v for name, labels, v in samples if name == "kiln:model_memory_bytes" and labels.get("model") == model]
    point.model_memory_bytes = int(sum(held)) if held else None
    cost = [v for name, labels, v in samples
            if name == "kiln:cost_per_1k_requests_usd" and labels.get("model") == model]
    point.server_cost_per_1k_usd = cost[0] if cost else None
