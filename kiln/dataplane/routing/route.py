"""A live route: its weights (manual, or driven by a canary), its chooser,
its shadows; and the table of routes by public name.

Invariant: `chooser` always reflects `weights()`; every weight change
builds a new chooser and swaps it in one assignment, so a request picks its
target from one consistent set of weights, and requests already sent keep
the target they were given (they finish there).
"""

from __future__ import annotations

import random
from typing import Any

from kiln.dataplane.routing.canary import STOPPED, CanaryController, Decision
from kiln.dataplane.routing.chooser import WeightedChooser
from kiln.dataplane.routing.spec import RouteSpec
from kiln.dataplane.routing.target import Target
from kiln.errors import ConfigError


class Route:
    def __init__(self, name: str, spec: RouteSpec, now: float, rng: random.Random | None = None):
        self.name = name
        self.spec = spec
        self.rng = rng or random.Random()
        self.manual: dict[str, float] = dict(spec.targets)  # relative weights, as given
        self.canary = CanaryController(spec.canary, now) if spec.canary is not None else None
        self.shadows = {Target.parse(t): fraction for t, fraction in spec.shadow.items()}
        self.targets = {t: Target.parse(t) for t in self.manual}
        self._rebuild()

    def weights(self) -> dict[str, float]:
        """The weight of every target now. With a running (or finished) canary,
        weights are percents: the canary's share, the rest split among the
        other targets in proportion to their given weights."""
        canary = self.canary
        if canary is None or canary.state == STOPPED:
            return dict(self.manual)
        others = {t: w for t, w in self.manual.items() if t != canary.target}
        total = sum(others.values())
        # No baseline weight left (a 100% canary): the canary is the route.
        weights = {t: (100.0 - canary.share) * w / total if total > 0 else 0.0 for t, w in others.items()}
        weights[canary.target] = canary.share
        return {t: weights[t] for t in self.manual}

    def choose(self, key: str | None) -> Target:
        return self.targets[self.chooser.choose(key)]

    def shadows_for(self) -> list[Target]:
        """The shadow targets this request is copied to (each by its fraction)."""
        return [t for t, fraction in self.shadows.items() if fraction >= 1 or self.rng.random() < fraction]

    def record(self, target: Target, ok: bool, latency_s: float | None) -> None:
        if self.canary is not None:
            self.canary.record(str(target), ok, latency_s)

    def tick(self, now: float) -> Decision | None:
        if self.canary is None:
            return None
        decision = self.canary.tick(now)
        if decision is not None and decision.kind != "hold":
            self._rebuild()
        return decision

    def set_weights(self, weights: dict[str, float]) -> None:
        """Manual weights for some targets (new ones join); stops a running canary."""
        merged = {**self.weights(), **weights}
        if not any(w > 0 for w in merged.values()):
            raise ConfigError(f"route '{self.name}' needs at least one target with a positive weight")
        both = [t for t in weights if Target.parse(t) in self.shadows]
        if both:
            raise ConfigError(f"route '{self.name}': '{both[0]}' cannot be both a target and a shadow of one route")
        self.manual = merged
        self.targets = {t: Target.parse(t) for t in merged}
        if self.canary is not None:
            self.canary.stop()
        self._rebuild()

    def _rebuild(self) -> None:
        self.chooser = WeightedChooser(self.weights(), self.rng)

    def describe(self) -> dict[str, Any]:
        weights = self.weights()
        total = sum(weights.values())
        doc: dict[str, Any] = {
            "name": self.name,
            "targets": [{"target": t, "weight": w, "share": w / total} for t, w in weights.items()],
            "shadow": [{"target": str(t), "fraction": f} for t, f in self.shadows.items()],
            "canary": None,
        }
        if self.canary is not None:
            c = self.canary
            doc["canary"] = {
                "target": c.target,
                "state": c.state,
                "stage": c.stage + 1,
                "steps": list(c.spec.steps),
                "share": c.share,
                "stage_requests": {"canary": c.canary.requests, "baseline": c.baseline.requests},
                "stage_errors": {"canary": c.canary.errors, "baseline": c.baseline.errors},
                "last_decision": None if c.last is None else {"kind": c.last.kind, "reason": c.last.reason},
            }
        return doc


class RouteTable:
    """Routes by public name (on the event loop only: no locks)."""

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()
        self.routes: dict[str, Route] = {}

    def get(self, name: str | None) -> Route | None:
        return self.routes.get(name) if name is not None else None

    def names(self) -> list[str]:
        return sorted(self.routes)

    def put(self, name: str, spec: RouteSpec, now: float) -> Route:
        route = Route(name, spec, now, self.rng)
        self.routes[name] = route
        return route

    def remove(self, name: str) -> Route | None:
        return self.routes.pop(name, None)

    def tick(self, now: float) -> list[tuple[Route, Decision]]:
        decisions = []
        for route in list(self.routes.values()):
            decision = route.tick(now)
            if decision is not None:
                decisions.append((route, decision))
        return decisions
