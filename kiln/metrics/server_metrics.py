"""Request and engine metrics of the served LLMs.

Names follow vLLM's with a `kiln:` prefix, so dashboards port over. Every
metric carries `model_name`: `LLMMetricFamilies` defines each metric once per
registry (a server's), and `ServerMetrics` is one model's view of them.
Engine counters (prefix-cache queries and hits, preemptions, speculative
draft and accepted tokens) arrive as running totals (`StepStats`); they are
turned into counter increments here, so the Prometheus counters stay
monotonic.

This module knows no engine class: it reads the plain fields the two small
protocols below name (the engine's EngineStats and AsyncLLM's RequestTimes
have them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class StepStats(Protocol):
    """Gauges after an engine step, and running totals since the engine started."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_blocks_used(self) -> int: ...
    @property
    def kv_blocks_total(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def num_scheduled_seqs(self) -> int: ...  # 0 outside a step
    @property
    def step_seconds(self) -> float: ...
    @property
    def spec_num_draft_tokens(self) -> int: ...
    @property
    def spec_num_accepted_tokens(self) -> int: ...


class RequestTiming(Protocol):
    """Timestamps (time.monotonic) of one request so far."""

    @property
    def arrival(self) -> float: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def first_token(self) -> float | None: ...
    @property
    def last_token(self) -> float | None: ...
    @property
    def num_generated(self) -> int: ...


TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

SUCCESS_REASONS = ("stop", "length")


class LLMMetricFamilies:
    """Every LLM metric, defined once on `registry`, labelled by model_name."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.running = gauge("kiln:num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("kiln:num_requests_waiting", "Requests waiting in the engine's queue.")
        self.kv_usage = gauge("kiln:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_queries = counter("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("kiln:num_preemptions", "Requests preempted by the scheduler.")
        self.spec_drafts = counter("kiln:spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).")
        self.spec_accepted = counter("kiln:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.")
        self.prompt_tokens = counter(
            "kiln:prompt_tokens", "Prompt tokens processed, per engine request: each of a request's n choices "
            "counts its prompt (the response's usage.prompt_tokens counts it once).",
        )
        self.generation_tokens = counter("kiln:generation_tokens", "Tokens generated.")
        self.success = Counter(
            "kiln:request_success", "Requests finished, by reason.", ["model_name", "finished_reason"],
            registry=registry,
        )
        self.failure = Counter(
            "kiln:request_failure", "Requests that did not finish, by reason.", ["model_name", "reason"],
            registry=registry,
        )
        self.ttft = hist("kiln:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = hist(
            "kiln:time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            TOKEN_BUCKETS,
        )
        self.itl = hist("kiln:inter_token_latency_seconds", "Time between consecutive token deliveries.", TOKEN_BUCKETS)
        self.e2e = hist("kiln:e2e_request_latency_seconds", "Request latency, arrival to last token.", E2E_BUCKETS)
        self.queue_time = hist(
            "kiln:request_queue_time_seconds", "Time from arrival to first scheduling.", TTFT_BUCKETS
        )
        self.batch_size = hist("kiln:batch_size", "Sequences per engine step.", BATCH_BUCKETS)
        self.step_duration = hist("kiln:step_duration_seconds", "Duration of one engine step.", STEP_BUCKETS)
        self.engine_restarts = counter(
            "kiln:engine_restarts", "Replacement engines started after the engine died (one that failed to start "
            "counts too: each uses the restart budget).")


class ServerMetrics:
    """One model's view of the LLM metrics; implements async_llm.EngineObserver."""

    def __init__(self, families: LLMMetricFamilies, model_name: str):
        self.model_name = model_name
        f, name = families, model_name
        self.running, self.waiting = f.running.labels(name), f.waiting.labels(name)
        self.kv_usage = f.kv_usage.labels(name)
        self.prefix_queries, self.prefix_hits = f.prefix_queries.labels(name), f.prefix_hits.labels(name)
        self.preemptions = f.preemptions.labels(name)
        self.spec_drafts, self.spec_accepted = f.spec_drafts.labels(name), f.spec_accepted.labels(name)
        self.prompt_tokens, self.generation_tokens = f.prompt_tokens.labels(name), f.generation_tokens.labels(name)
        self.ttft, self.tpot, self.itl = f.ttft.labels(name), f.tpot.labels(name), f.itl.labels(name)
        self.e2e, self.queue_time = f.e2e.labels(name), f.queue_time.labels(name)
        self.batch_size, self.step_duration = f.batch_size.labels(name), f.step_duration.labels(name)
        self.engine_restarts = f.engine_restarts.labels(name)
        self.success, self.failure = f.success, f.failure
        for reason in SUCCESS_REASONS:
            self.success.labels(name, reason)
        for reason in ("abort", "engine_dead", "rejected", "error"):
            self.failure.labels(name, reason)
        # StepStats running total -> the counter it feeds, and its last value.
        self._totals = {
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "num_preemptions": self.preemptions,
            "spec_num_draft_tokens": self.spec_drafts,
            "spec_num_accepted_tokens": self.spec_accepted,
        }
        self._last_totals = dict.fromkeys(self._totals, 0)

    # ---- EngineObserver ------------------------------------------------------
    def on_step(self, stats: StepStats | None, queue_times: Iterable[float]) -> None:
        """After an engine step: its stats (None if it sent none) and the queue
        times of the requests it scheduled for the first time."""
        for seconds in queue_times:
            self.queue_time.observe(seconds)
        if stats is None:
            return
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        for name, counter in self._totals.items():
            total = getattr(stats, name)
            counter.inc(max(0, total - self._last_totals[name]))
            self._last_totals[name] = total
        if stats.num_scheduled_seqs > 0:
            self.batch_size.observe(stats.num_scheduled_seqs)
            self.step_duration.observe(stats.step_seconds)

    def on_tokens(self, times: RequestTiming, num_new: int, now: float) -> None:
        if times.first_token is None:
            self.ttft.observe(now - times.arrival)
            self.prompt_tokens.inc(times.num_prompt_tokens)
        elif times.last_token is not None:
            self.itl.observe(now - times.last_token)
        self.generation_tokens.inc(num_new)

    def on_finished(self, times: RequestTiming, finish_reason: str) -> None:
        self.success.labels(self.model_name, finish_reason).inc()
        end = times.last_token or times.arrival
        self.e2e.observe(end - times.arrival)
        if times.first_token is not None and times.num_generated > 1:
            self.tpot.observe((end - times.first_token) / (times.num_generated - 1))

    def on_failed(self, times: RequestTiming, reason: str) -> None:
        self.failure.labels(self.model_name, reason).inc()

    def on_engine_died(self) -> None:
        """The engine is gone with every request it held: nothing runs, waits or holds KV
        blocks (its last readings would stay on the gauges through the restart, or for good)."""
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0.0)

    def on_engine_restarting(self) -> None:
        """A replacement engine is being started (it may fail to come up: still a restart)."""
        self.engine_restarts.inc()

    def on_engine_restarted(self) -> None:
        """A new engine replaced a dead one: its running totals start again from zero."""
        self._last_totals = dict.fromkeys(self._totals, 0)

    def on_rejected(self) -> None:
        """A request refused before reaching the engine (overload)."""
        self.failure.labels(self.model_name, "rejected").inc()
