"""Sending a workload: Poisson arrivals at a request rate, or a fixed number
of requests in flight, or both (the rate paces, the concurrency caps).

A warm-up of a few requests runs first and is not measured.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import httpx

from kiln.bench.client import RequestResult, Target, send
from kiln.bench.dataset import WorkItem


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = math.inf  # requests per second; inf = all at once
    max_concurrency: int | None = None
    seed: int = 0


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


async def run_load(
    target: Target, items: list[WorkItem], shape: LoadShape, timeout_s: float, warmup: int = 2
) -> tuple[list[RequestResult], float]:
    """Returns per-request results (in workload order) and the measured wall time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        for item in items[:warmup]:
            await send(client, target, WorkItem(item.prompt, min(item.max_tokens, 8)))
        gate = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None

        async def one(item: WorkItem) -> RequestResult:
            if gate is None:
                return await send(client, target, item)
            async with gate:
                return await send(client, target, item)

        started = time.perf_counter()
        tasks = []
        for item, gap in zip(items, arrival_gaps(len(items), shape.request_rate, shape.seed), strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(item)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - started
