"""The desired-replicas hint: how many replicas one replica's load calls for.

Pure logic, fed one `LoadSample` at a time (the data plane samples every
model once a second); no clock, no I/O, so a recorded trace replays exactly.

The formula (docs/scaling.md, "The desired-replicas hint"). Per update, with
dt the seconds since the last one and a = 1 - exp(-dt / smoothing_s):

    lam  <- EWMA of the arrival rate      (requests/s: Delta arrivals / dt)
    thr  <- EWMA of the completion rate   (requests/s: Delta finished / dt)
    busy <- EWMA of requests in service   (in flight minus queued)
    q    <- EWMA of the queue length
    lat  <- EWMA of the mean latency (arrival to end) of the requests that
            finished in the interval (intervals with none leave it alone)

    service = min(busy / thr, lat)        Little's law on the requests in
                                          service; a request's latency bounds it
    raw     = (lam + q / backlog_drain_s) * service / target_requests
    (nothing finished yet: raw = (busy + q) / target_requests)

`raw` is the number of replicas, each holding `target_requests` requests in
service, that this replica's arrivals plus its backlog (drained within
`backlog_drain_s`) need. Replicas behind one load balancer each see their
share of the traffic, so the sum of their hints is the total.

Stabilised: the hint is the largest `raw` of the last `downscale_window_s`
seconds, so it rises with the smoothed load at once and falls only after the
load stayed low for a whole window; a burst shorter than the smoothing time
moves it by its share of the window's arrivals, not by its peak.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class HintConfig:
    target_requests: float = 8.0  # requests in service per replica the hint aims at
    smoothing_s: float = 10.0  # EWMA time constant of every input
    downscale_window_s: float = 60.0  # the hint is the max of `raw` over this window
    backlog_drain_s: float = 30.0  # a queue is to be drained within this time

    def __post_init__(self) -> None:
        for name in ("target_requests", "smoothing_s", "backlog_drain_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.downscale_window_s < 0:
            raise ValueError("downscale_window_s must be non-negative")


@dataclass(frozen=True)
class LoadSample:
    """One model's load at `now` (seconds, any monotonic clock).

    `arrivals`, `finished` and `latency_s` are running totals (requests that
    arrived, requests that ended in any way, and the summed latency of the
    finished ones); a total that goes down (the model was reloaded) restarts
    from there. `queued` and `in_flight` are counts now (in_flight includes
    the queued).
    """

    now: float
    arrivals: int
    finished: int
    latency_s: float
    queued: int
    in_flight: int


@dataclass
class Smoothed:
    """The EWMAs behind the hint (exposed for metrics and tests)."""

    arrival_rate: float = 0.0
    completion_rate: float = 0.0
    busy: float = 0.0
    queued: float = 0.0
    latency_s: float | None = None

    def service_s(self) -> float | None:
        """Mean seconds a request spends in service, or None before anything finished.

        `busy` is sampled (once a second in the data plane): an unbiased estimate of the mean
        requests in service, noisy only while few short requests run.
        """
        if self.latency_s is None:
            return None
        if self.completion_rate <= 0.0:
            return self.latency_s
        return min(self.busy / self.completion_rate, self.latency_s)


SERVICE_SMOOTHING = 3.0  # the service time's inputs are smoothed this many times longer


class DesiredReplicas:
    def __init__(self, config: HintConfig | None = None):
        self.config = config or HintConfig()
        self.smoothed = Smoothed()
        self.raw = 0.0
        self.value = 0.0
        self._last: LoadSample | None = None
        self._window: deque[tuple[float, float]] = deque()  # (time, raw), raw strictly decreasing

    def update(self, sample: LoadSample) -> float:
        """Take one sample; returns the hint."""
        last, self._last = self._last, sample
        if last is None or sample.now <= last.now:
            return self.value
        dt = sample.now - last.now
        alpha = 1.0 - math.exp(-dt / self.config.smoothing_s)
        s = self.smoothed
        finished = _delta(sample.finished, last.finished)
        if finished > 0:  # latency is smoothed over the intervals in which requests finished
            mean_latency = _delta(sample.latency_s, last.latency_s) / finished
            s.latency_s = mean_latency if s.latency_s is None else s.latency_s + alpha * (mean_latency - s.latency_s)
        s.arrival_rate += alpha * (_delta(sample.arrivals, last.arrivals) / dt - s.arrival_rate)
        # Service time changes slowly; its inputs are smoothed longer, so that a
        # jump in requests in service (new replicas) does not read as slower service.
        slow = 1.0 - math.exp(-dt / (SERVICE_SMOOTHING * self.config.smoothing_s))
        s.completion_rate += slow * (finished / dt - s.completion_rate)
        s.busy += slow * (max(0, sample.in_flight - sample.queued) - s.busy)
        s.queued += alpha * (sample.queued - s.queued)
        self.raw = self._raw()
        self.value = self._stabilised(sample.now, self.raw)
        return self.value

    def _raw(self) -> float:
        s, c = self.smoothed, self.config
        service = s.service_s()
        if service is None:
            return (s.busy + s.queued) / c.target_requests
        return (s.arrival_rate + s.queued / c.backlog_drain_s) * service / c.target_requests

    def _stabilised(self, now: float, raw: float) -> float:
        """Max of raw over the window: a monotonic deque (O(1) amortised per sample)."""
        window = self._window
        while window and window[-1][1] <= raw:
            window.pop()
        window.append((now, raw))
        while window[0][0] < now - self.config.downscale_window_s:
            window.popleft()
        return window[0][1]


def _delta(now: float, before: float) -> float:
    """Increase of a running total; a total that went down restarted from zero."""
    return now - before if now >= before else now
