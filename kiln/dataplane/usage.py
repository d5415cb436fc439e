"""What each served model version used: busy time, requests, output tokens.

Busy time is what the process spent working for the model:
- an LLM engine: the duration of each engine step (schedule, forward pass,
  sampling, update), reported by the engine in EngineStats.step_seconds;
  the engine loop waiting for work is idle;
- a batched repository model: the duration of each backend execution of a
  batch (input preparation, compute, output), summed over its instances;
- ensembles have none of their own (their steps' models have it).
Requests are the ones completed successfully; output tokens the tokens an
LLM engine generated (every choice, stopped or not).
"""

from __future__ import annotations

from collections.abc import Iterable

from kiln.dataplane.load import CountingObserver
from kiln.metrics.cost import UsageReading, UsageTotals
from kiln.metrics.server_metrics import RequestTiming, ServerMetrics, StepStats
from kiln.serving.stats import ModelStats


class UsageObserver:
    """An engine observer: forwards every event to the model's metrics and
    adds the engine's use up in `totals`."""

    def __init__(self, metrics: ServerMetrics | CountingObserver, totals: UsageTotals):
        self.metrics = metrics
        self.totals = totals

    def on_step(self, stats: StepStats | None, queue_times: Iterable[float]) -> None:
        self.metrics.on_step(stats, queue_times)
        if stats is not None:
            self.totals.busy_s += stats.step_seconds

    def on_tokens(self, times: RequestTiming, num_new: int, now: float) -> None:
        self.metrics.on_tokens(times, num_new, now)
        self.totals.output_tokens += num_new

    def on_finished(self, times: RequestTiming, finish_reason: str) -> None:
        self.metrics.on_finished(times, finish_reason)
        self.totals.requests += 1

    def on_failed(self, times: RequestTiming, reason: str) -> None:
        self.metrics.on_failed(times, reason)

    def __getattr__(self, name: str):
        # Any other observer event goes to the metrics unchanged.
        return getattr(self.metrics, name)


def llm_reading(totals: UsageTotals) -> UsageReading:
    return UsageReading(totals.busy_s, totals.requests, totals.output_tokens, llm=True)


def batched_reading(stats: ModelStats) -> UsageReading:
    """A batched model version's use, from its statistics (per batch, not per request)."""
    busy_ns = sum(b.compute_input.ns + b.compute_infer.ns + b.compute_output.ns for b in stats.batches.values())
    return UsageReading(busy_ns / 1e9, stats.success.count, 0, llm=False)
