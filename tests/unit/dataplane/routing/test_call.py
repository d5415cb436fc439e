"""A routed request's record: once, with its outcome, latency, TTFT and TPOT
(fake clock, fake engine streams)."""

import asyncio
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from kiln.dataplane.routing.call import CANCELLED, CLIENT_ERROR, ERROR, OK, RouteCall, classify
from kiln.dataplane.routing.route import Route
from kiln.dataplane.routing.spec import RouteSpec
from kiln.dataplane.routing.target import Target
from kiln.errors import EngineDeadError, InvalidRequestError, OverloadedError
from kiln.metrics.route_metrics import RouteMetrics


@dataclass
class Out:
    delta_token_ids: list[int]
    finished: bool = False


@dataclass
class FakeStream:
    """Yields `outputs`, advancing the clock by `step` before each; `error` after them if set."""

    clock: list[float]
    outputs: list[Out]
    step: float = 0.1
    error: Exception | None = None
    request_id: str = "r-0"
    finished: bool = False
    closed: list[bool] = field(default_factory=list)

    def close(self):
        self.closed.append(True)

    async def __aiter__(self):
        for out in self.outputs:
            self.clock[0] += self.step
            self.finished = out.finished
            yield out
        if self.error is not None:
            raise self.error


def make_call(clock):
    metrics = RouteMetrics(CollectorRegistry())
    route = Route("r", RouteSpec(targets={"m@1": 1}), now=0.0)
    return RouteCall(route, Target("m", 1), metrics, clock=lambda: clock[0]), metrics


def sample(metrics, family, suffix="_count"):
    for metric in family.collect():
        for s in metric.samples:
            if s.name.endswith(suffix) and s.labels == {"route": "r", "target": "m@1"}:
                return s.value
    return 0.0


def test_outcomes_are_classified_by_who_failed():
    assert classify(None) == OK
    assert classify(InvalidRequestError("bad")) == CLIENT_ERROR
    assert classify(OverloadedError("full")) == ERROR and classify(RuntimeError("x")) == ERROR
    assert classify(asyncio.CancelledError()) == CANCELLED and classify(GeneratorExit()) == CANCELLED


def test_streams_time_first_token_and_tokens_and_the_call_finishes_with_the_last():
    clock = [0.0]
    call, metrics = make_call(clock)
    a = FakeStream(clock, [Out([1]), Out([2, 3]), Out([4], finished=True)], request_id="a")
    b = FakeStream(clock, [Out([]), Out([7]), Out([8], finished=True)], request_id="b")

    async def consume():
        tracked = call.track([a, b])
        assert [t.request_id for t in tracked] == ["a", "b"]
        async for _ in tracked[0]:
            pass
        assert call.outcome is None  # b still open
        async for _ in tracked[1]:
            pass

    asyncio.run(consume())
    assert call.outcome == OK
    assert sample(metrics, metrics.ttft, "_sum") == pytest.approx(0.1)  # the first token of any choice
    # a: tokens at 0.1, 0.2 (two), 0.3 -> (0.3 - 0.1) / 3; b: first token at 0.5, last at 0.6 -> 0.1 / 1
    assert sample(metrics, metrics.tpot, "_sum") == pytest.approx(0.2 / 3 + 0.1)
    assert sample(metrics, metrics.latency, "_sum") == pytest.approx(0.6)
    assert sample(metrics, metrics.requests, "_total") == 1 and sample(metrics, metrics.errors, "_total") == 0


def test_an_engine_error_in_any_stream_makes_the_request_an_error():
    clock = [0.0]
    call, metrics = make_call(clock)
    good = FakeStream(clock, [Out([1], finished=True)])
    dead = FakeStream(clock, [Out([1])], error=EngineDeadError("died"))

    async def consume():
        ok, bad = call.track([good, dead])
        async for _ in ok:
            pass
        with pytest.raises(EngineDeadError):
            async for _ in bad:
                pass

    asyncio.run(consume())
    assert call.outcome == ERROR and sample(metrics, metrics.errors, "_total") == 1


def test_closing_before_the_end_is_a_cancellation_and_is_not_timed():
    clock = [0.0]
    call, metrics = make_call(clock)
    (tracked,) = call.track([FakeStream(clock, [Out([1]), Out([2], finished=True)])])
    tracked.close()
    tracked.close()  # idempotent
    assert call.outcome == CANCELLED and tracked.stream.closed == [True, True]
    assert sample(metrics, metrics.requests, "_total") == 1 and sample(metrics, metrics.latency) == 0


def test_finish_counts_once():
    clock = [0.0]
    call, metrics = make_call(clock)
    call.finish(InvalidRequestError("bad prompt"))
    call.finish(RuntimeError("later"))
    assert call.outcome == CLIENT_ERROR
    assert sample(metrics, metrics.requests, "_total") == 1 and sample(metrics, metrics.errors, "_total") == 0
    assert call.route.canary is None


def test_usage_observer_adds_up_engine_use_and_forwards_every_event():
    from types import SimpleNamespace

    from kiln.dataplane.usage import UsageObserver
    from kiln.metrics.cost import UsageTotals

    events = []

    class Metrics:
        def __getattr__(self, name):
            return lambda *args: events.append(name)

    totals = UsageTotals()
    observer = UsageObserver(Metrics(), totals)
    observer.on_step(SimpleNamespace(step_seconds=0.25), [])
    observer.on_step(None, [0.1])
    observer.on_tokens(None, 3, 1.0)
    observer.on_finished(None, "stop")
    observer.on_failed(None, "abort")
    observer.on_rejected()  # not an engine event: forwarded as it is
    assert totals == UsageTotals(busy_s=0.25, requests=1, output_tokens=3)
    assert events == ["on_step", "on_step", "on_tokens", "on_finished", "on_failed", "on_rejected"]
