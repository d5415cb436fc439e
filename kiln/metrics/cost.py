"""Cost per 1,000 requests and per 1M output tokens, from measured busy time.

Over a sliding window of span S seconds (`--cost-window-s`, default 300):

    C          = price_per_hour * S / 3600            the server's cost in the window
    share_m    = B_m / sum_k B_k                      B_m: busy seconds of model version m
    cost_m     = C * share_m
    per 1k requests        = 1000 * cost_m / R_m      R_m: requests m completed successfully
    per 1M output tokens   = 1e6  * cost_m / T_m      T_m: tokens an LLM generated (LLMs only)

Idle time is not lost: the whole window's price is shared among the models
in proportion to their busy time, so the gauges are the fully loaded cost at
the load the server saw. A window in which nothing was busy attributes
nothing (the gauges are absent, as they are for a model with no completed
request). docs/operations.md says what "busy" means for each kind of model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.metrics.window import SlidingWindow


@dataclass
class UsageTotals:
    """Cumulative use of one engine (or model version) since it started."""

    busy_s: float = 0.0
    requests: int = 0
    output_tokens: int = 0


class UsageReading(NamedTuple):
    busy_s: float
    requests: int
    output_tokens: int
    llm: bool


class Cost(NamedTuple):
    busy_fraction: float  # busy seconds per second of the window
    cost_usd: float
    per_1k_requests: float | None
    per_1m_output_tokens: float | None


def attribute_cost(
    price_per_hour: float, span_s: float, usage: dict[Hashable, tuple[float, float, float]]
) -> dict[Hashable, Cost]:
    """Each key's share of the window's cost; `usage` maps key -> (busy_s, requests, output_tokens) in the window."""
    if span_s <= 0:
        return {}
    window_cost = price_per_hour * span_s / 3600.0
    total_busy = sum(busy for busy, _, _ in usage.values())
    out = {}
    for key, (busy, requests, tokens) in usage.items():
        cost = window_cost * busy / total_busy if total_busy > 0 else 0.0
        attributable = total_busy > 0
        out[key] = Cost(
            busy_fraction=busy / span_s,
            cost_usd=cost,
            per_1k_requests=1000.0 * cost / requests if attributable and requests > 0 else None,
            per_1m_output_tokens=1e6 * cost / tokens if attributable and tokens > 0 else None,
        )
    return out


ModelKey = tuple[str, str]  # (model, version)
UsageSource = Callable[[], dict[ModelKey, UsageReading]]
# (route, target, the model version serving the target now)
RouteTargetSource = Callable[[], list[tuple[str, str, ModelKey]]]


class CarriedTotals:
    """Usage readings kept cumulative when a model version goes away or restarts.

    The window shares its price by busy time, so the busy time a version spent in
    the window must stay in the sum after it is unloaded (or replaced by a new
    version), else the versions still loaded take its share: one unload once made
    another model's cost per 1,000 requests 680x. A version whose counters went
    down (reloaded) adds its last totals to an offset; one that is gone keeps its
    last totals, frozen, until `forget` (once the window holds no use of it)."""

    def __init__(self) -> None:
        self.last: dict[ModelKey, UsageReading] = {}
        self.offset: dict[ModelKey, tuple[float, float, float]] = {}

    def __call__(self, readings: dict[ModelKey, UsageReading]) -> dict[ModelKey, UsageReading]:
        for key, reading in readings.items():
            last = self.last.get(key)
            if last is not None and any(now < before for now, before in zip(reading[:3], last[:3], strict=True)):
                self.offset[key] = _plus(self.offset.get(key), last)
            self.last[key] = reading
        return {key: _carried(reading, self.offset.get(key)) for key, reading in self.last.items()}

    def gone(self, readings: dict[ModelKey, UsageReading]) -> set[ModelKey]:
        return set(self.last) - set(readings)

    def forget(self, key: ModelKey) -> None:
        self.last.pop(key, None)
        self.offset.pop(key, None)


def _plus(offset: tuple[float, float, float] | None, reading: UsageReading) -> tuple[float, float, float]:
    base = offset or (0.0, 0.0, 0.0)
    return (base[0] + reading.busy_s, base[1] + reading.requests, base[2] + reading.output_tokens)


def _carried(reading: UsageReading, offset: tuple[float, float, float] | None) -> UsageReading:
    if offset is None:
        return reading
    busy, requests, tokens = _plus(offset, reading)
    return UsageReading(busy, int(requests), int(tokens), reading.llm)


class CostCollector(Collector):
    """Busy fraction per model version; with a price, the cost gauges."""

    def __init__(
        self,
        usage: UsageSource,
        price_per_hour: float | None,
        window_s: float,
        route_targets: RouteTargetSource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.usage = usage
        self.price_per_hour = price_per_hour
        self.route_targets = route_targets or (lambda: [])
        self.clock = clock
        self.window = SlidingWindow(window_s)
        self.totals = CarriedTotals()

    def sample(self) -> None:
        self.window.add(self.clock(), _counters(self.totals(self.usage())))

    def costs(self) -> tuple[float, dict[Hashable, Cost], set[ModelKey]]:
        """(window span, cost of each model version, the LLM keys). A version no
        longer loaded counts while its use lies in the window, then drops out."""
        loaded = self.usage()
        readings = self.totals(loaded)
        if not self.window.samples:
            self.window.add(self.clock(), _counters(readings))
        span, deltas = self.window.deltas(self.clock(), _counters(readings))
        base = self.window.samples[0][1]
        for key in self.totals.gone(loaded):
            if key in base and not any(deltas[key]):
                self.totals.forget(key)
                del deltas[key]
        usage = {k: (d[0], d[1], d[2]) for k, d in deltas.items()}
        llms = {k for k, r in readings.items() if r.llm}
        return span, attribute_cost(self.price_per_hour or 0.0, span, usage), llms

    def collect(self) -> Iterator:
        span, costs, llms = self.costs()
        labels = ["model", "version"]
        busy = GaugeMetricFamily(
            "kiln:model_busy_fraction", "Busy seconds per second over the cost window (engine steps or backend "
            "executions, each counted when it ends, so one engine can read a step's length over 1; several "
            "instances can exceed 1).", labels=labels,
        )
        for (model, version), cost in _sorted(costs):
            busy.add_metric([model, version], cost.busy_fraction)
        yield busy
        window = GaugeMetricFamily("kiln:cost_window_seconds", "Span of the window the busy and cost gauges cover.")
        window.add_metric([], span)
        yield window
        if self.price_per_hour is None:
            return
        price = GaugeMetricFamily("kiln:server_price_per_hour_usd", "The configured price of this server per hour.")
        price.add_metric([], self.price_per_hour)
        yield price
        per_req = GaugeMetricFamily(
            "kiln:cost_per_1k_requests_usd", "Cost of 1,000 successful requests over the window.", labels=labels
        )
        per_tok = GaugeMetricFamily(
            "kiln:cost_per_1m_output_tokens_usd", "Cost of 1M generated tokens over the window (LLMs).", labels=labels
        )
        for key, cost in _sorted(costs):
            if cost.per_1k_requests is not None:
                per_req.add_metric(list(key), cost.per_1k_requests)
            if key in llms and cost.per_1m_output_tokens is not None:
                per_tok.add_metric(list(key), cost.per_1m_output_tokens)
        yield from (per_req, per_tok)
        route_labels = ["route", "target"]
        route_req = GaugeMetricFamily(
            "kiln:route_cost_per_1k_requests_usd", "Cost per 1,000 requests of the model version a route target "
            "resolves to.", labels=route_labels,
        )
        route_tok = GaugeMetricFamily(
            "kiln:route_cost_per_1m_output_tokens_usd", "Cost per 1M output tokens of the model version a route "
            "target resolves to.", labels=route_labels,
        )
        for route, target, key in self.route_targets():
            target_cost = costs.get(key)
            if target_cost is None:
                continue
            if target_cost.per_1k_requests is not None:
                route_req.add_metric([route, target], target_cost.per_1k_requests)
            if key in llms and target_cost.per_1m_output_tokens is not None:
                route_tok.add_metric([route, target], target_cost.per_1m_output_tokens)
        yield from (route_req, route_tok)


def _counters(readings: dict[ModelKey, UsageReading]) -> dict[Hashable, tuple[float, ...]]:
    return {k: (float(r.busy_s), float(r.requests), float(r.output_tokens)) for k, r in readings.items()}


def _sorted(costs: dict[Hashable, Cost]) -> list[tuple[ModelKey, Cost]]:
    return sorted(((k, c) for k, c in costs.items() if isinstance(k, tuple)), key=lambda kc: kc[0])
