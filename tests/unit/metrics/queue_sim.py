"""A seeded queue simulation whose replica count follows the desired-replicas hint.

Requests arrive as a Poisson process whose rate follows a profile (idle,
ramps, steps, one-off bursts); each replica serves `slots` requests at once,
each for `service_s` seconds, FIFO from one shared queue (what a
least-loaded balancer does). Every second the cluster's load is sampled into
a `DesiredReplicas`; the replica count follows ceil(hint), clamped to
[min_replicas, max_replicas]: new replicas serve after `startup_s`, removed
ones stop taking work at once (they finish what they run). The hint is
computed on the cluster's total load, which is the sum of the per-replica
hints when replicas see equal shares.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kiln.metrics.desired_replicas import DesiredReplicas, HintConfig, LoadSample


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate: float  # requests/s at the start of the phase
    end_rate: float | None = None  # linear ramp to this rate (None: constant)
    burst: int = 0  # requests arriving together at the start of the phase

    def rate_at(self, t: float) -> float:
        if self.end_rate is None:
            return self.rate
        return self.rate + (self.end_rate - self.rate) * t / self.seconds


@dataclass
class Tick:
    """What one second of the simulation looked like."""

    t: float
    rate: float
    hint: float
    raw: float
    wanted: int  # ceil(hint), clamped
    serving: int  # replicas taking work
    queued: int
    in_flight: int


@dataclass
class Cluster:
    service_s: float = 2.0
    slots: int = 8
    min_replicas: int = 1
    max_replicas: int = 8
    startup_s: float = 15.0
    hint: HintConfig = field(default_factory=lambda: HintConfig(target_requests=8.0))
    seed: int = 0
    dt: float = 0.05

    def run(self, phases: list[Phase]) -> list[Tick]:
        rng = np.random.default_rng(self.seed)
        desired = DesiredReplicas(self.hint)
        queue: deque[float] = deque()  # arrival times
        running: deque[tuple[float, float]] = deque()  # (end, arrival), in end order (fixed service time)
        serving, starting = self.min_replicas, []  # starting: times new replicas become ready
        arrivals = finished = 0
        latency = 0.0
        ticks: list[Tick] = []
        t, next_sample = 0.0, 0.0
        for phase in phases:
            start = t
            for _ in range(phase.burst):
                queue.append(t)
            arrivals += phase.burst
            while t < start + phase.seconds - 1e-9:
                rate = phase.rate_at(t - start)
                n = int(rng.poisson(rate * self.dt))
                queue.extend([t + self.dt * (i + 1) / (n + 1) for i in range(n)])
                arrivals += n
                t += self.dt
                while running and running[0][0] <= t:
                    _, arrived = running.popleft()
                    finished += 1
                    latency += t - arrived
                serving += sum(1 for ready in starting if ready <= t)
                starting = [ready for ready in starting if ready > t]
                while queue and len(running) < serving * self.slots:
                    running.append((t + self.service_s, queue.popleft()))
                if t >= next_sample - 1e-9:
                    next_sample += 1.0
                    sample = LoadSample(t, arrivals, finished, latency, len(queue), len(queue) + len(running))
                    hint = desired.update(sample)
                    wanted = min(self.max_replicas, max(self.min_replicas, math.ceil(hint - 1e-9)))
                    have = serving + len(starting)
                    if wanted > have:
                        starting += [t + self.startup_s] * (wanted - have)
                    elif wanted < have:
                        drop = have - wanted
                        cancelled = min(drop, len(starting))
                        starting = starting[: len(starting) - cancelled]
                        serving -= drop - cancelled
                    in_flight = len(queue) + len(running)
                    ticks.append(Tick(t, rate, hint, desired.raw, wanted, serving, len(queue), in_flight))
        return ticks


def changes(ticks: list[Tick]) -> list[tuple[float, int, int]]:
    """(time, before, after) of every change of the wanted replica count."""
    return [(b.t, a.wanted, b.wanted) for a, b in zip(ticks, ticks[1:], strict=False) if b.wanted != a.wanted]


def episodes(ticks: list[Tick]) -> int:
    """Runs of changes in one direction (1 -> 2 -> 3 is one scale-up)."""
    directions = [after > before for _, before, after in changes(ticks)]
    return sum(1 for i, d in enumerate(directions) if i == 0 or d != directions[i - 1])


def first_time(ticks: list[Tick], after: float, condition) -> float | None:
    """Seconds after `after` until the first tick meeting `condition`, or None."""
    for tick in ticks:
        if tick.t >= after and condition(tick):
            return tick.t - after
    return None
