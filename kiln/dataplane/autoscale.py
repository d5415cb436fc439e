"""The metrics an autoscaler needs, per model: queue length, the oldest
wait, requests in flight, and the desired-replicas hint
(kiln/metrics/desired_replicas.py), on the server's registry.

The data plane samples every model once a second (`run`); /metrics reads
queue, wait and in-flight live and the hint as of the last sample. The
totals of a model's serving objects (engines, versions) are merged into
running totals per model that only grow, so reloading a model does not
read as a burst or a drop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.dataplane.load import SourceLoad
from kiln.metrics.desired_replicas import DesiredReplicas, HintConfig, LoadSample

log = logging.getLogger(__name__)

SAMPLE_PERIOD_S = 1.0
LABELS = ["model_name"]


@dataclass
class ModelTotals:
    """Running totals of one model over all its serving objects, ever."""

    arrivals: int = 0
    finished: int = 0
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        self._seen: dict[int, SourceLoad] = {}

    def merge(self, sources: list[SourceLoad]) -> None:
        """Add what each source did since it was last seen (a new source: all it did)."""
        seen = {}
        for source in sources:
            before = self._seen.get(source.key, SourceLoad(key=source.key))
            if source.finished < before.finished or source.rejected < before.rejected:
                before = SourceLoad(key=source.key)  # a new object under a reused id: all it did is new
            self.finished += source.finished - before.finished
            self.arrivals += (source.finished + source.rejected) - (before.finished + before.rejected)
            self.latency_s += source.latency_s - before.latency_s
            seen[source.key] = source
        self._seen = seen

    def sample(self, now: float, sources: list[SourceLoad]) -> LoadSample:
        in_flight = sum(s.in_flight for s in sources)
        # In flight now counts as arrived: arrivals = ended + refused + in flight.
        return LoadSample(now, self.arrivals + in_flight, self.finished, self.latency_s,
                          sum(s.queued for s in sources), in_flight)


class AutoscaleMonitor(Collector):
    def __init__(self, loads: Callable[[], dict[str, list[SourceLoad]]], config: HintConfig,
                 clock: Callable[[], float] = time.monotonic):
        self.loads = loads
        self.config = config
        self.clock = clock
        self.totals: dict[str, ModelTotals] = {}
        self.hints: dict[str, DesiredReplicas] = {}

    def sample(self) -> None:
        """Feed every model's load now into its hint; forget models no longer served."""
        now, loads = self.clock(), self.loads()
        for name in set(self.hints) - set(loads):
            del self.hints[name], self.totals[name]
        for name, sources in loads.items():
            totals = self.totals.setdefault(name, ModelTotals())
            totals.merge(sources)
            self.hints.setdefault(name, DesiredReplicas(self.config)).update(totals.sample(now, sources))

    async def run(self, period_s: float = SAMPLE_PERIOD_S) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a bad sample must not stop the sampling
                log.exception("autoscaling metrics: sampling failed")
            await asyncio.sleep(period_s)

    def desired_replicas(self) -> dict[str, float]:
        return {name: hint.value for name, hint in self.hints.items()}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queue, oldest, in_flight, desired, rate, service = families = _families()
        for name, sources in sorted(self.loads().items()):
            queue.add_metric([name], sum(s.queued for s in sources))
            oldest.add_metric([name], max((s.oldest_wait_s for s in sources), default=0.0))
            in_flight.add_metric([name], sum(s.in_flight for s in sources))
            hint = self.hints.get(name)
            if hint is not None:
                desired.add_metric([name], hint.value)
                rate.add_metric([name], hint.smoothed.arrival_rate)
                service.add_metric([name], hint.smoothed.service_s() or 0.0)
        yield from families

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from _families()


def _families() -> tuple[GaugeMetricFamily, ...]:
    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=LABELS)

    return (
        gauge("kiln:queue_length", "Requests waiting to start (LLM: no token yet; others: in the batch queue)."),
        gauge("kiln:queue_oldest_wait_seconds", "How long the oldest waiting request has waited."),
        gauge("kiln:requests_in_flight", "Requests accepted and not finished (queued or in service)."),
        gauge("kiln:desired_replicas", "Replicas this replica's load calls for (sum over replicas, round up)."),
        gauge("kiln:autoscale_arrival_rate", "Smoothed arrival rate behind the hint, requests/s."),
        gauge("kiln:autoscale_service_seconds", "Smoothed service time behind the hint, seconds."),
    )
