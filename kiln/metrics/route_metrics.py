"""Metrics of routes: per-target traffic, shadows, weights and canary decisions.

Labels are `route` and `target` (`model@version` or `model`). Errors count
server-side failures only (5xx-class and unexpected ones), the same rule the
canary judges by; client errors count as requests, not errors. Latency is
from route resolution to the last byte of the answer the server produced.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CANARY_STATES = ("running", "complete", "rolled_back", "stopped")


class RouteMetrics:
    def __init__(self, registry: CollectorRegistry):
        labels = ["route", "target"]
        r = registry
        self.requests = Counter("kiln:route_requests", "Requests a route sent to a target.", labels, registry=r)
        self.errors = Counter(
            "kiln:route_errors", "Requests of a route that failed on the server side, by target.", labels, registry=r
        )
        self.latency = Histogram(
            "kiln:route_request_latency_seconds", "Latency of a route's requests, by target.", labels,
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "kiln:route_time_to_first_token_seconds", "Time to first token of a route's LLM requests, by target.",
            labels, buckets=TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "kiln:route_time_per_output_token_seconds",
            "Mean time per output token after the first, per LLM choice, by target.", labels,
            buckets=TPOT_BUCKETS, registry=r,
        )
        self.weight = Gauge("kiln:route_weight", "A target's weight in its route now.", labels, registry=r)
        self.share = Gauge("kiln:route_share", "A target's share of its route's traffic now (0-1).", labels, registry=r)
        self.weight_changes = Counter(
            "kiln:route_weight_changes", "Weight changes of a route, by source (file, admin, canary).",
            ["route", "source"], registry=r,
        )
        self.shadow_requests = Counter(
            "kiln:route_shadow_requests", "Copies of a route's requests sent to a shadow target.", labels, registry=r
        )
        self.shadow_errors = Counter(
            "kiln:route_shadow_errors", "Shadow copies that failed (never seen by the caller).", labels, registry=r
        )
        self.shadow_latency = Histogram(
            "kiln:route_shadow_latency_seconds", "Latency of shadow copies.", labels,
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.shadow_dropped = Counter(
            "kiln:route_shadow_dropped", "Shadow copies not sent because too many were running.", labels, registry=r
        )
        self.canary_steps = Counter("kiln:canary_step", "Canary stages passed (share stepped up).", labels, registry=r)
        self.canary_rollbacks = Counter("kiln:canary_rollback", "Canaries rolled back to 0.", labels, registry=r)
        self.canary_holds = Counter(
            "kiln:canary_hold", "Canary stages that ran past their interval without enough requests.", labels,
            registry=r,
        )
        self.canary_state = Gauge(
            "kiln:canary_state", "1 for the canary's current state.", ["route", "target", "state"], registry=r
        )

    def set_weights(self, route: str, weights: dict[str, float]) -> None:
        total = sum(weights.values()) or 1.0
        for target, weight in weights.items():
            self.weight.labels(route, target).set(weight)
            self.share.labels(route, target).set(weight / total)

    def set_canary_state(self, route: str, target: str, state: str) -> None:
        for s in CANARY_STATES:
            self.canary_state.labels(route, target, s).set(1.0 if s == state else 0.0)

    def forget(self, route: str, targets: list[str], canary: str | None) -> None:
        """Drop a removed route's gauges (its counters stay, as counters do)."""
        for target in targets:
            for gauge in (self.weight, self.share):
                with contextlib.suppress(KeyError):
                    gauge.remove(route, target)
        if canary is not None:
            for s in CANARY_STATES:
                with contextlib.suppress(KeyError):
                    self.canary_state.remove(route, canary, s)
