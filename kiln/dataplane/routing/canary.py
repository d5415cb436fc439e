"""A canary: one target's share of a route's traffic stepped up on a
schedule, judged against the baseline, rolled back to 0 when it fails.

The controller is pure logic on a clock passed in (`now`), so tests run it
on a fake clock. Stages follow `spec.steps` (percent of the route's
traffic). Within a stage the canary and the baseline (every other target of
the route) each collect requests; once both have `min_requests`, every tick
judges them:

- rollback at once if canary_error_rate - baseline_error_rate >
  max_error_rate_increase, or if canary_latency_q / baseline_latency_q >
  max_latency_ratio (latency quantile `latency_quantile` of successful
  requests; skipped while either side has none);
- after `interval_s` in the stage, step to the next stage (the counts start
  again); after the last stage, or on entering a 100% stage (no baseline
  left to compare with), the canary is complete and keeps its share;
- a stage past `interval_s` without enough requests on both sides holds
  (reported once per stage) until it has them.

Errors are server-side failures only (the caller decides): a client error
counts as a request of its side but neither as an error nor in latency;
cancellations are not recorded. The error-rate rule is exact (rational
arithmetic): a canary exactly `max_error_rate_increase` above the baseline
passes, as the spec says "at most".
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction

from kiln.dataplane.routing.spec import CanarySpec

RUNNING, COMPLETE, ROLLED_BACK, STOPPED = "running", "complete", "rolled_back", "stopped"
STATES = (RUNNING, COMPLETE, ROLLED_BACK, STOPPED)
MAX_LATENCY_SAMPLES = 10_000


@dataclass
class SideStats:
    """Requests of one side (canary or baseline) in the current stage."""

    requests: int = 0
    errors: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_LATENCY_SAMPLES))

    def record(self, ok: bool, latency_s: float | None) -> None:
        """One request; ok: no server-side failure; `latency_s` None: not timed (a client error)."""
        self.requests += 1
        if not ok:
            self.errors += 1
        elif latency_s is not None:
            self.latencies.append(latency_s)

    @property
    def error_rate(self) -> Fraction:
        return Fraction(self.errors, self.requests) if self.requests else Fraction(0)

    def quantile(self, q: float) -> float | None:
        """The nearest-rank q-quantile of the successful latencies (None: none yet)."""
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class Decision:
    kind: str  # step | complete | rollback | hold
    share: float  # the canary's percent of traffic after the decision
    reason: str


class CanaryController:
    def __init__(self, spec: CanarySpec, now: float):
        self.spec = spec
        self.state = RUNNING
        self.stage = 0
        self.stage_start = now
        self.canary = SideStats()
        self.baseline = SideStats()
        self.last: Decision | None = None
        self._held = False
        if spec.steps[0] >= 100:
            self.state = COMPLETE

    @property
    def target(self) -> str:
        return self.spec.target

    @property
    def share(self) -> float:
        """The canary's percent of the route's traffic now."""
        return 0.0 if self.state == ROLLED_BACK else self.spec.steps[self.stage]

    def record(self, target: str, ok: bool, latency_s: float | None) -> None:
        if self.state == RUNNING:
            (self.canary if target == self.spec.target else self.baseline).record(ok, latency_s)

    def stop(self) -> None:
        """A manual weight change overrides the schedule, and a finished canary's
        share too: a rolled-back one stays at 0 only until someone sets weights."""
        self.state = STOPPED

    def tick(self, now: float) -> Decision | None:
        """The decision due at `now`, if any (applied to the controller's state)."""
        if self.state != RUNNING:
            return None
        judged = self.canary.requests >= self.spec.min_requests and self.baseline.requests >= self.spec.min_requests
        if judged:
            violation = self.violation()
            if violation is not None:
                self.state = ROLLED_BACK
                return self._decide("rollback", violation)
        if now - self.stage_start < self.spec.interval_s:
            return None
        if not judged:
            if self._held:
                return None
            self._held = True
            return self._decide(
                "hold",
                f"stage {self.stage + 1} needs {self.spec.min_requests} requests on each side "
                f"(canary {self.canary.requests}, baseline {self.baseline.requests})",
            )
        return self._advance(now)

    def violation(self) -> str | None:
        """Why the canary is out of bounds in this stage, or None."""
        spec, canary, baseline = self.spec, self.canary, self.baseline
        # The limit as written (0.02 is 1/50, not the float below it): 7/100 against 5/100 passes.
        if canary.error_rate - baseline.error_rate > Fraction(repr(spec.max_error_rate_increase)):
            return (
                f"error rate {float(canary.error_rate):.3f} exceeds the baseline's {float(baseline.error_rate):.3f} "
                f"by more than {spec.max_error_rate_increase}"
            )
        if spec.max_latency_ratio is None:
            return None
        mine, theirs = canary.quantile(spec.latency_quantile), baseline.quantile(spec.latency_quantile)
        if mine is not None and theirs is not None and theirs > 0 and mine / theirs > spec.max_latency_ratio:
            return (
                f"p{spec.latency_quantile * 100:g} latency {mine:.4f}s is {mine / theirs:.2f}x the baseline's "
                f"{theirs:.4f}s (limit {spec.max_latency_ratio}x)"
            )
        return None

    def _advance(self, now: float) -> Decision:
        passed = f"stage {self.stage + 1} ({self.share:g}%) passed with {self.canary.requests} canary requests"
        if self.stage == len(self.spec.steps) - 1:
            self.state = COMPLETE
            return self._decide("complete", passed)
        self.stage += 1
        self.stage_start = now
        self.canary, self.baseline = SideStats(), SideStats()
        self._held = False
        if self.spec.steps[self.stage] >= 100:
            self.state = COMPLETE
            return self._decide("complete", passed + "; at 100% no baseline is left to judge against")
        return self._decide("step", passed)

    def _decide(self, kind: str, reason: str) -> Decision:
        self.last = Decision(kind, self.share, reason)
        return self.last
