"""What loads a served model now: the inputs of the autoscaling metrics.

A model is served by one LLM engine (`ServedLLM`) or by its loaded versions
(`LoadedVersion`); each reports a `SourceLoad`: running totals since it
started (requests that ended, requests refused for overload, their summed
latency) and counts now (queued, in flight, the oldest wait). "Queued" means
not started: an LLM request with no token yet, a repository request in its
batcher's queue.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kiln.metrics.server_metrics import RequestTiming, ServerMetrics, StepStats
from kiln.serving.repository.version import LoadedVersion


@dataclass(frozen=True)
class SourceLoad:
    key: int  # identifies the serving object: totals of different keys are independent
    finished: int = 0
    rejected: int = 0
    latency_s: float = 0.0
    queued: int = 0
    in_flight: int = 0
    oldest_wait_s: float = 0.0


@dataclass
class RequestTotals:
    """Running totals of one LLM engine's requests."""

    finished: int = 0  # ended in any way: finished, aborted, failed
    rejected: int = 0  # refused before reaching the engine (overload)
    latency_s: float = 0.0  # summed arrival-to-end time of the finished


class CountingObserver:
    """The engine observer of a served LLM: its metrics, plus the totals."""

    def __init__(self, metrics: ServerMetrics, totals: RequestTotals):
        self.metrics = metrics
        self.totals = totals

    def on_step(self, stats: StepStats | None, queue_times: Iterable[float]) -> None:
        self.metrics.on_step(stats, queue_times)

    def on_tokens(self, times: RequestTiming, num_new: int, now: float) -> None:
        self.metrics.on_tokens(times, num_new, now)

    def on_finished(self, times: RequestTiming, finish_reason: str) -> None:
        self.metrics.on_finished(times, finish_reason)
        self._ended(times, times.last_token)

    def on_failed(self, times: RequestTiming, reason: str) -> None:
        self.metrics.on_failed(times, reason)
        self._ended(times, None)

    def _ended(self, times: RequestTiming, end: float | None) -> None:
        self.totals.finished += 1
        self.totals.latency_s += (end if end is not None else time.monotonic()) - times.arrival


def version_load(version: LoadedVersion) -> SourceLoad:
    stats = version.stats
    return SourceLoad(
        key=id(version),
        finished=stats.success.count + stats.fail.count,
        latency_s=(stats.success.ns + stats.fail.ns) / 1e9,
        queued=version.queue_size(),
        in_flight=version.inflight,
        oldest_wait_s=version.oldest_wait_s(),
    )
