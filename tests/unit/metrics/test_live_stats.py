"""Live dashboard figures from a registry: rates and percentiles over the window, exact values."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge

from kiln.metrics.live_stats import STALE, LiveStats, histogram_quantile
from kiln.metrics.route_metrics import RouteMetrics
from kiln.metrics.server_metrics import LLMMetricFamilies
from kiln.serving.metrics import ServingMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_histogram_quantile_interpolates_within_the_bucket():
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.4, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.1 * (5 - 2) / 4)  # rank 5 in (0.1, 0.2]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)  # rank 1 in (0, 0.1]
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2 + 0.2 * (9.9 - 6) / 4)
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_llm_rates_and_percentiles_cover_only_the_window():
    registry, clock = CollectorRegistry(), Clock()
    families = LLMMetricFamilies(registry)
    families.success.labels("smol", "stop").inc(100)  # before the window: not in the rate
    families.e2e.labels("smol").observe(50.0)
    stats = LiveStats(registry, window_s=10.0, clock=clock)
    first = stats.read(["smol"], [], {})
    assert first["window_s"] is None and first["models"]["smol"]["request_rate"] is None

    clock.t += 4.0
    families.success.labels("smol", "stop").inc(6)
    families.success.labels("smol", "length").inc(2)
    families.failure.labels("smol", "abort").inc(2)
    families.generation_tokens.labels("smol").inc(400)
    for seconds in (0.2, 0.2, 0.4, 0.4):  # buckets 0.1 < x <= 0.3 and 0.3 < x <= 0.5
        families.e2e.labels("smol").observe(seconds)
    families.batch_size.labels("smol").observe(4)
    families.batch_size.labels("smol").observe(8)
    families.running.labels("smol").set(3)
    families.kv_usage.labels("smol").set(0.25)
    smol = stats.read(["smol"], [], {})["models"]["smol"]
    assert smol["request_rate"] == 10 / 4 and smol["error_rate"] == 2 / 4
    assert smol["output_tokens_per_s"] == 100.0
    assert smol["batch_size"] == 6.0 and smol["running"] == 3 and smol["kv_cache_usage"] == 0.25
    # rank 2 of 4 falls at the top of (0.1, 0.3]: 300 ms; rank 3.96 near the top of (0.3, 0.5]
    assert smol["latency_ms"]["p50"] == pytest.approx(300.0)
    assert smol["latency_ms"]["p99"] == pytest.approx((0.3 + 0.2 * 1.96 / 2) * 1000)
    assert smol["ttft_ms"] is None  # no observation in the window


def test_repository_models_sum_their_versions_and_routes_have_their_own_figures():
    registry, clock = CollectorRegistry(), Clock()
    serving, routes = ServingMetrics(registry), RouteMetrics(registry)
    stats = LiveStats(registry, window_s=10.0, clock=clock)
    stats.read([], ["m"], {"r": ["m@1"]})
    clock.t += 2.0
    for version, n in (("1", 3), ("2", 1)):
        for _ in range(n):
            serving.request_done("m", version, True, 20_000_000)  # 20 ms
    serving.execution("m", "1", rows=8, input_ns=0, infer_ns=0, output_ns=0)
    routes.requests.labels("r", "m@1").inc(4)
    routes.errors.labels("r", "m@1").inc(1)
    routes.weight.labels("r", "m@1").set(90)
    out = stats.read([], ["m"], {"r": ["m@1"]})
    m = out["models"]["m"]
    assert m["kind"] == "repository" and m["request_rate"] == 2.0 and m["error_rate"] == 0.0
    assert m["inferences_per_s"] == 4.0 and m["batch_size"] == 8.0
    assert 10.0 < m["latency_ms"]["p50"] <= 25.0  # in the (10 ms, 25 ms] bucket
    target = out["routes"]["r"]["m@1"]
    assert target["request_rate"] == 2.0 and target["error_rate"] == 0.5 and target["weight"] == 90


def test_a_long_idle_gap_starts_the_window_afresh():
    registry, clock = CollectorRegistry(), Clock()
    families = LLMMetricFamilies(registry)
    stats = LiveStats(registry, window_s=10.0, clock=clock)
    stats.read(["smol"], [], {})
    clock.t += STALE * 10.0 + 1
    families.success.labels("smol", "stop").inc(5)
    assert stats.read(["smol"], [], {})["models"]["smol"]["request_rate"] is None
    clock.t += 1.0
    families.success.labels("smol", "stop").inc(3)
    assert stats.read(["smol"], [], {})["models"]["smol"]["request_rate"] == 3.0


def test_queue_and_in_flight_come_from_the_autoscaling_gauges_of_each_model():
    registry = CollectorRegistry()
    queue = Gauge("kiln:queue_length", "", ["model_name"], registry=registry)
    in_flight = Gauge("kiln:requests_in_flight", "", ["model_name"], registry=registry)
    queue.labels("m").set(3)
    in_flight.labels("m").set(5)
    queue.labels("other").set(7)
    out = LiveStats(registry).read(["m"], ["other"], {})["models"]
    assert (out["m"]["queue_length"], out["m"]["in_flight"]) == (3, 5)
    assert (out["other"]["queue_length"], out["other"]["in_flight"]) == (7, None)


def test_a_gpu_listed_under_several_models_counts_once():
    registry = CollectorRegistry()
    util = Gauge("kiln:device_utilization_perc", "", ["model_name", "device"], registry=registry)
    util.labels("a", "0").set(0.5)
    util.labels("b", "0").set(0.5)
    util.labels("a", "1").set(0.25)
    gpus = LiveStats(registry).read([], [], {})["server"]["gpus"]
    assert [(g["device"], g["utilisation"]) for g in gpus] == [("0", 0.5), ("1", 0.25)]


def test_a_models_cost_per_request_over_its_versions_is_total_cost_over_total_requests():
    # Version 1: busy 0.3 of the window at $0.006 per 1k; version 2: busy 0.1 at $0.002.
    # Their costs are 3:1 (busy shares), their requests 0.3/0.006 : 0.1/0.002 = 50 : 50, so the
    # model's figure is 0.4 / (50 + 50) = $0.004 per 1k (the sum of the two said $0.008).
    registry = CollectorRegistry()
    busy = Gauge("kiln:model_busy_fraction", "", ["model", "version"], registry=registry)
    per_1k = Gauge("kiln:cost_per_1k_requests_usd", "", ["model", "version"], registry=registry)
    for version, b, c in (("1", 0.3, 0.006), ("2", 0.1, 0.002)):
        busy.labels("m", version).set(b)
        per_1k.labels("m", version).set(c)
    out = LiveStats(registry, window_s=10.0, clock=Clock()).read([], ["m"], {})
    assert out["models"]["m"]["cost_per_1k_usd"] == pytest.approx(0.004)
    assert out["models"]["m"]["busy_fraction"] == pytest.approx(0.4)  # busy shares do add up
