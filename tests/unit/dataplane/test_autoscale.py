"""The autoscaling metrics of the data plane: queue length, oldest wait and
in-flight per model read live; totals merged over a model's serving objects;
the desired-replicas hint sampled from them."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.dataplane.autoscale import AutoscaleMonitor
from kiln.dataplane.load import SourceLoad
from kiln.llm.engine.async_llm import AsyncLLM, RequestTimes
from kiln.metrics.desired_replicas import HintConfig
from kiln.serving.types import InferRequest
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import DOUBLER_PY, doubler_config, write_model


def scrape(registry) -> dict[tuple[str, str], float]:
    """{(metric, model_name): value} of the kiln: autoscaling gauges."""
    values = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if "model_name" in sample.labels:
                values[(sample.name, sample.labels["model_name"])] = sample.value
    return values


def test_repository_model_queue_wait_and_in_flight_are_live(tmp_path):
    # One instance, no dynamic batching, 300 ms per request: 4 at once = 1 running + 3 queued.
    write_model(tmp_path, "slow", doubler_config(parameters={"delay_ms": 300}), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        request = InferRequest("slow", {"IN": np.ones((1, 2), np.float32)})
        calls = [asyncio.create_task(plane.infer(request)) for _ in range(4)]
        await asyncio.sleep(0.15)
        during = scrape(plane.registry)
        await asyncio.gather(*calls)
        plane.autoscale.sample()
        after = scrape(plane.registry)
        totals = plane.autoscale.totals["slow"]
        await plane.shutdown()
        return during, after, totals

    during, after, totals = asyncio.run(main())
    assert during[("kiln:queue_length", "slow")] == 3
    assert during[("kiln:requests_in_flight", "slow")] == 4
    assert 0.1 <= during[("kiln:queue_oldest_wait_seconds", "slow")] < 1.0
    assert after[("kiln:queue_length", "slow")] == 0 and after[("kiln:requests_in_flight", "slow")] == 0
    assert after[("kiln:queue_oldest_wait_seconds", "slow")] == 0
    assert (totals.arrivals, totals.finished) == (4, 4)
    # Latencies: 0.3, 0.6, 0.9, 1.2 s (served one after the other).
    assert totals.latency_s == pytest.approx(3.0, abs=0.4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_reloading_a_model_is_neither_a_burst_nor_a_drop():
    clock, state = FakeClock(), {"m": [SourceLoad(key=1, finished=100, latency_s=200.0, in_flight=8)]}
    monitor = AutoscaleMonitor(lambda: state, HintConfig(target_requests=8, smoothing_s=5), clock)
    for t in range(1, 200):
        clock.now = t
        # 4/s finish after 2 s each; 8 in flight.
        state["m"] = [SourceLoad(key=1, finished=100 + 4 * t, latency_s=200.0 + 8 * t, in_flight=8)]
        monitor.sample()
    before = monitor.hints["m"].value
    # Version 2 takes over (its totals start at zero) while version 1 finishes its last requests.
    for t in range(200, 400):
        clock.now = t
        new = SourceLoad(key=2, finished=4 * (t - 200), latency_s=8.0 * (t - 200), in_flight=8)
        state["m"] = [new] if t > 202 else [SourceLoad(key=1, finished=900, latency_s=1800.0), new]
        monitor.sample()
    totals = monitor.totals["m"]
    assert before == pytest.approx(1.0, rel=0.02)
    assert monitor.hints["m"].value == pytest.approx(1.0, rel=0.05)
    assert totals.finished == 900 + 4 * 199
    # Every arrival counted once: the ended ones plus the 8 in flight now.
    assert monitor.totals["m"].sample(clock.now, state["m"]).arrivals == totals.finished + 8


def test_refused_requests_count_as_arrivals_not_as_finished():
    clock, state = FakeClock(), {"m": [SourceLoad(key=1)]}
    monitor = AutoscaleMonitor(lambda: state, HintConfig(), clock)
    monitor.sample()
    clock.now, state["m"] = 1.0, [SourceLoad(key=1, finished=2, rejected=5, latency_s=1.0)]
    monitor.sample()
    totals = monitor.totals["m"]
    assert (totals.arrivals, totals.finished) == (7, 2)


def test_a_model_no_longer_served_is_forgotten():
    state = {"a": [SourceLoad(key=1)], "b": [SourceLoad(key=2)]}
    monitor = AutoscaleMonitor(lambda: state, HintConfig())
    monitor.sample()
    del state["b"]
    monitor.sample()
    assert set(monitor.hints) == set(monitor.totals) == {"a"}


def test_oldest_pending_age_is_the_oldest_request_without_a_token():
    engine = AsyncLLM(client=None)  # type: ignore[arg-type]  # only its request bookkeeping is used
    assert engine.oldest_pending_age() == 0.0
    now = time.monotonic()
    engine._times = {"a": RequestTimes(now - 2.0, 3), "b": RequestTimes(now - 5.0, 3), "c": RequestTimes(now - 1.0, 3)}
    engine._pending = {"a", "c"}  # b has its first token
    assert engine.oldest_pending_age() == pytest.approx(2.0, abs=0.5)


def test_a_new_source_under_a_reused_key_only_adds():
    state = {"m": [SourceLoad(key=7, finished=50, latency_s=100.0)]}
    monitor = AutoscaleMonitor(lambda: state, HintConfig())
    monitor.sample()
    state["m"] = [SourceLoad(key=7, finished=3, latency_s=6.0)]  # a new engine that got the old one's id()
    monitor.sample()
    assert monitor.totals["m"].finished == 53 and monitor.totals["m"].latency_s == pytest.approx(106.0)
