"""One routed request: the target it was given and what became of it.

`RouteCall.finish` records the request exactly once (counts, latency, the
canary's sample). An LLM request hands its engine streams to `track`; the
call then finishes when the last of them ends, and each stream reports its
time to first token and time per output token on the way.

Outcomes: ok; error (server side: a KilnError of status >= 500 or anything
unexpected); client_error (a 4xx: counted as a request, not an error);
cancelled (the client went away: counted, no latency, not judged).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from kiln.dataplane.routing.route import Route
from kiln.dataplane.routing.target import Target
from kiln.errors import KilnError
from kiln.metrics.route_metrics import RouteMetrics

OK, ERROR, CLIENT_ERROR, CANCELLED = "ok", "error", "client_error", "cancelled"


def classify(exc: BaseException | None) -> str:
    if exc is None:
        return OK
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return CANCELLED
    if isinstance(exc, KilnError) and exc.http_status < 500:
        return CLIENT_ERROR
    return ERROR


class RouteCall:
    def __init__(self, route: Route, target: Target, metrics: RouteMetrics,
                 clock: Callable[[], float] = time.perf_counter):
        self.route = route
        self.target = target
        self.metrics = metrics
        self.clock = clock
        self.start = clock()
        self.outcome: str | None = None
        self._open = 0
        self._stream_error: BaseException | None = None
        self._first_token: float | None = None

    @property
    def labels(self) -> tuple[str, str]:
        return self.route.name, str(self.target)

    def finish(self, exc: BaseException | None = None) -> None:
        """Record the request (only the first call counts)."""
        if self.outcome is not None:
            return
        self.outcome = outcome = classify(exc)
        if isinstance(exc, KilnError):
            exc.route_target = str(self.target)
        seconds = self.clock() - self.start
        self.metrics.requests.labels(*self.labels).inc()
        if outcome == ERROR:
            self.metrics.errors.labels(*self.labels).inc()
        if outcome in (OK, ERROR):
            self.metrics.latency.labels(*self.labels).observe(seconds)
        if outcome != CANCELLED:  # a client error counts as a request of its side, untimed
            self.route.record(self.target, outcome != ERROR, seconds if outcome == OK else None)

    # ---- LLM streams -----------------------------------------------------------
    def track(self, streams: list[Any]) -> list[Any]:
        """Wrap engine streams; the call finishes when every one has ended."""
        self._open += len(streams)
        return [TrackedStream(s, self) for s in streams]

    def _first(self, now: float) -> None:
        if self._first_token is None:
            self._first_token = now
            self.metrics.ttft.labels(*self.labels).observe(now - self.start)

    def _stream_ended(self, exc: BaseException | None) -> None:
        if exc is not None and (self._stream_error is None or classify(self._stream_error) == CANCELLED):
            self._stream_error = exc
        self._open -= 1
        if self._open == 0:
            self.finish(self._stream_error)


class TrackedStream:
    """An engine RequestStream as the frontends use it (iterate once, close),
    timing its tokens for the route's metrics."""

    def __init__(self, stream: Any, call: RouteCall):
        self.stream = stream
        self.call = call
        self.request_id = stream.request_id
        self._ended = False
        self._completed = False
        self._first: float | None = None
        self._last = 0.0
        self._tokens = 0

    @property
    def finished(self) -> bool:
        return self.stream.finished

    def close(self) -> None:
        """Abort the request unless it finished (idempotent); closing early counts as cancelled."""
        self.stream.close()
        self._end(None if self._completed else asyncio.CancelledError())

    async def __aiter__(self) -> AsyncGenerator[Any, None]:
        try:
            async for out in self.stream:
                if out.delta_token_ids:
                    now = self.call.clock()
                    if self._first is None:
                        self._first = now
                        self.call._first(now)
                    self._last = now
                    self._tokens += len(out.delta_token_ids)
                yield out
        except BaseException as exc:
            self._end(exc)
            raise
        self._completed = True
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        if self._ended:
            return
        self._ended = True
        if exc is None and self._first is not None and self._tokens > 1:
            tpot = (self._last - self._first) / (self._tokens - 1)
            self.call.metrics.tpot.labels(*self.call.labels).observe(tpot)
        self.call._stream_ended(exc)
