"""Live figures for the dashboard, read from a server's own metrics registry.

`LiveStats.read()` collects the registry (the numbers /metrics shows) and
compares it with the collection that opens a short sliding window (default
10 s, `SlidingWindow`): counters become rates, histograms become the
percentiles of the observations inside the window (interpolated within a
bucket, as Prometheus' `histogram_quantile` does), and gauges are read as
they are now. Reads drive the sampling: nothing is collected while no page
asks, and a window left idle for longer than `STALE` windows starts afresh
(its first read has no rates yet), so a rate never averages over a pause.

Per model (LLM metrics are labelled `model_name`, repository metrics
`model` and `version`, summed over versions) and per route target (`route`,
`target`). Values that do not apply, or have no observation in the window,
are None.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from kiln.metrics.window import SlidingWindow

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]
STALE = 3.0
QUANTILES = (0.5, 0.9, 0.99)


def read_registry(registry: CollectorRegistry) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """q-quantile from cumulative (upper bound, count) buckets; None without observations.

    Linear within the bucket the rank falls in (its lower bound is the previous
    bound, 0 for the first); a rank in the +Inf bucket gives the largest finite bound."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = (bound if not math.isinf(bound) else lower), count
    return lower


class Snapshot:
    """One read: values now, and their increase over the window (`span` seconds)."""

    def __init__(self, now: dict[Key, float], deltas: dict[Key, float], span: float):
        self.span = span
        self.now = _by_name(now)
        self.deltas = _by_name(deltas)

    def gauge(self, name: str, **match: str) -> float | None:
        values = [v for labels, v in self.now.get(name, ()) if _matches(labels, match)]
        return sum(values) if values else None

    def unit_cost(self, name: str, **match: str) -> float | None:
        """A cost per unit (`kiln:cost_per_1k_requests_usd`, per 1M tokens) over several
        versions: their total cost over their total units, not the sum of their figures.
        A version's cost is its busy share of the window, so that is the busy-weighted
        harmonic mean: sum(busy) / sum(busy / cost_per_unit)."""
        busy = {labels: v for labels, v in self.now.get("kiln:model_busy_fraction", ()) if _matches(labels, match)}
        pairs = [(busy.get(labels, 0.0), v) for labels, v in self.now.get(name, ())
                 if _matches(labels, match) and v > 0]
        if not pairs:
            return None
        units = sum(b / v for b, v in pairs)
        return sum(b for b, _ in pairs) / units if units > 0 else None

    def peak(self, name: str, **match: str) -> float | None:
        """The largest matching value: a device's gauge repeated under each model that uses it counts once."""
        values = [v for labels, v in self.now.get(name, ()) if _matches(labels, match)]
        return max(values) if values else None

    def rate(self, name: str, **match: str) -> float | None:
        if self.span <= 0:
            return None
        return sum(v for labels, v in self.deltas.get(name, ()) if _matches(labels, match)) / self.span

    def increase(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self.deltas.get(name, ()) if _matches(labels, match))

    def quantiles(self, name: str, **match: str) -> dict[str, float] | None:
        """p50/p90/p99 of a histogram's observations (in seconds) in the window, in milliseconds."""
        if self.span <= 0:
            return None
        by_bound: dict[float, float] = defaultdict(float)
        for labels, value in self.deltas.get(name + "_bucket", ()):
            if _matches(labels, match):
                by_bound[float(dict(labels)["le"])] += value
        out = {}
        for q in QUANTILES:
            seconds = histogram_quantile(q, list(by_bound.items()))
            if seconds is None:
                return None
            out[f"p{round(q * 100)}"] = seconds * 1000.0
        return out

    def mean(self, name: str, **match: str) -> float | None:
        count = self.increase(name + "_count", **match)
        return self.increase(name + "_sum", **match) / count if count > 0 else None

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({dict(labels)[label] for labels, _ in self.now.get(name, ()) if label in dict(labels)})


def _by_name(values: dict[Key, float]) -> dict[str, list[tuple[Labels, float]]]:
    out: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    for (name, labels), value in values.items():
        out[name].append((labels, value))
    return out


def _matches(labels: Labels, match: dict[str, str]) -> bool:
    if not match:
        return True
    present = dict(labels)
    return all(present.get(k) == v for k, v in match.items())


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class LiveStats:
    def __init__(self, registry: CollectorRegistry, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.window = SlidingWindow(window_s)
        self.clock = clock

    def snapshot(self) -> Snapshot:
        now = self.clock()
        current = read_registry(self.registry)
        samples = self.window.samples
        if samples and now - samples[-1][0] > STALE * self.window.window_s:
            samples.clear()  # idle for long: rates over the pause would mean nothing
        readings = {key: (value,) for key, value in current.items()}
        span, deltas = self.window.deltas(now, readings)
        self.window.add(now, readings)
        return Snapshot(current, {k: v[0] for k, v in deltas.items()}, span)

    def read(self, llms: Iterable[str], models: Iterable[str], routes: dict[str, list[str]]) -> dict[str, Any]:
        """Figures of the LLMs, the other models, and the targets of each route."""
        snap = self.snapshot()
        out: dict[str, Any] = {"window_s": round(snap.span, 3) or None, "models": {}, "routes": {}}
        for name in llms:
            out["models"][name] = llm_figures(snap, name)
        for name in models:
            out["models"][name] = model_figures(snap, name)
        for route, targets in routes.items():
            out["routes"][route] = {t: route_figures(snap, route, t) for t in targets}
        out["server"] = server_figures(snap)
        return out


def _cpu(snap: Snapshot, model_name: str) -> float | None:
    used = snap.rate("kiln:process_cpu_seconds_total", model_name=model_name)
    return None if used is None else used / _cores()


def _common(snap: Snapshot, name: str) -> dict[str, Any]:
    return {
        "queue_length": snap.gauge("kiln:queue_length", model_name=name),  # the autoscaling gauges' label
        "in_flight": snap.gauge("kiln:requests_in_flight", model_name=name),
        "busy_fraction": snap.gauge("kiln:model_busy_fraction", model=name),
        "cost_per_1k_usd": snap.unit_cost("kiln:cost_per_1k_requests_usd", model=name),
        "cpu_utilisation": _cpu(snap, name),
    }


def llm_figures(snap: Snapshot, name: str) -> dict[str, Any]:
    success = snap.rate("kiln:request_success_total", model_name=name)
    failure = snap.rate("kiln:request_failure_total", model_name=name)
    return {
        "kind": "llm",
        "request_rate": None if success is None else success + (failure or 0.0),
        "error_rate": failure,
        "running": snap.gauge("kiln:num_requests_running", model_name=name),
        "waiting": snap.gauge("kiln:num_requests_waiting", model_name=name),
        "batch_size": snap.mean("kiln:batch_size", model_name=name),
        "latency_ms": snap.quantiles("kiln:e2e_request_latency_seconds", model_name=name),
        "ttft_ms": snap.quantiles("kiln:time_to_first_token_seconds", model_name=name),
        "tpot_ms": snap.quantiles("kiln:time_per_output_token_seconds", model_name=name),
        "kv_cache_usage": snap.gauge("kiln:kv_cache_usage_perc", model_name=name),
        "output_tokens_per_s": snap.rate("kiln:generation_tokens_total", model_name=name),
        "cost_per_1m_tokens_usd": snap.unit_cost("kiln:cost_per_1m_output_tokens_usd", model=name),
        **_common(snap, name),
    }


def model_figures(snap: Snapshot, name: str) -> dict[str, Any]:
    success = snap.rate("kiln_inference_request_success_total", model=name)
    failure = snap.rate("kiln_inference_request_failure_total", model=name)
    return {
        "kind": "repository",
        "request_rate": None if success is None else success + (failure or 0.0),
        "error_rate": failure,
        "inferences_per_s": snap.rate("kiln_inference_count_total", model=name),
        "batch_size": snap.mean("kiln_inference_batch_size", model=name),
        "latency_ms": snap.quantiles("kiln_inference_request_latency_seconds", model=name),
        **_common(snap, name),
    }


def route_figures(snap: Snapshot, route: str, target: str) -> dict[str, Any]:
    labels = {"route": route, "target": target}
    return {
        "request_rate": snap.rate("kiln:route_requests_total", **labels),
        "error_rate": snap.rate("kiln:route_errors_total", **labels),
        "latency_ms": snap.quantiles("kiln:route_request_latency_seconds", **labels),
        "ttft_ms": snap.quantiles("kiln:route_time_to_first_token_seconds", **labels),
        "tpot_ms": snap.quantiles("kiln:route_time_per_output_token_seconds", **labels),
        "weight": snap.gauge("kiln:route_weight", **labels),
        "share": snap.gauge("kiln:route_share", **labels),
        "cost_per_1k_usd": snap.gauge("kiln:route_cost_per_1k_requests_usd", **labels),
    }


def _server_cpu(snap: Snapshot) -> float | None:
    """CPU of every server process over the cores; the API process, listed once per LLM, counts once."""
    if snap.span <= 0:
        return None
    api, others = 0.0, 0.0
    for labels, value in snap.deltas.get("kiln:process_cpu_seconds_total", ()):
        if dict(labels).get("process") == "api":
            api = max(api, value)
        else:
            others += value
    return (api + others) / snap.span / _cores()


def server_figures(snap: Snapshot) -> dict[str, Any]:
    gpus = []
    for device in snap.label_values("kiln:device_utilization_perc", "device"):
        gpus.append({
            "device": device,
            "utilisation": snap.peak("kiln:device_utilization_perc", device=device),
            "memory_used_bytes": snap.peak("kiln:device_memory_used_bytes", device=device),
            "memory_total_bytes": snap.peak("kiln:device_memory_total_bytes", device=device),
        })
    return {
        "cpu_utilisation": _server_cpu(snap),
        "price_per_hour_usd": snap.gauge("kiln:server_price_per_hour_usd"),
        "gpus": gpus,
    }
