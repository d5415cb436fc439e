"""The data plane's routes: loading and changing them, choosing a target
per request, shadow copies, canary ticks, and the metrics and log lines of
every decision.

Every change (start-up, admin API, canary) builds the new route state
completely, then swaps it in one assignment on the event loop: a request
resolves its target from one consistent state, and requests already on
their way finish on the target they were given.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from kiln.dataplane.routing.call import CANCELLED, ERROR, OK, RouteCall, classify
from kiln.dataplane.routing.canary import Decision
from kiln.dataplane.routing.route import Route, RouteTable
from kiln.dataplane.routing.shadow import ShadowDispatcher
from kiln.dataplane.routing.spec import RouteSpec, check_route_name
from kiln.dataplane.routing.target import Target
from kiln.dataplane.routing.validate import Catalog, check_routes, route_problems, target_problems
from kiln.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from kiln.metrics.route_metrics import RouteMetrics

log = logging.getLogger("kiln.routes")

# Why a target cannot take traffic now, or None when it can.
Readiness = Callable[[Target], str | None]


class Router:
    def __init__(
        self,
        registry: CollectorRegistry,
        catalog: Callable[[], Catalog],
        readiness: Readiness,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        self.table = RouteTable(rng)
        self.metrics = RouteMetrics(registry)
        self.shadows = ShadowDispatcher()
        self.catalog = catalog
        self.readiness = readiness
        self.clock = clock

    # ---- routes --------------------------------------------------------------
    def is_route(self, name: str | None) -> bool:
        return self.table.get(name) is not None

    def route(self, name: str) -> Route:
        route = self.table.get(name)
        if route is None:
            raise ModelNotFoundError(f"route '{name}' does not exist; routes: {self.table.names()}")
        return route

    def load(self, specs: Mapping[str, RouteSpec]) -> None:
        """The routes of the routes file (start-up): all valid, or ConfigError naming every problem."""
        check_routes(specs, self.catalog())
        for name, spec in specs.items():
            self._install(name, spec, "file")

    def put(self, name: str, spec: RouteSpec) -> Route:
        """Create or replace a route (admin API); targets given traffic must be ready."""
        check_route_name(name)
        problems = route_problems(name, spec, self.catalog())
        if problems:
            raise ConfigError("; ".join(problems))
        return self._install(name, spec, "admin", check_ready=True)

    def _install(self, name: str, spec: RouteSpec, source: str, check_ready: bool = False) -> Route:
        route = Route(name, spec, self.clock(), self.table.rng)
        if check_ready:
            self._check_ready(name, route.weights())
        old = self.table.routes.get(name)
        old_targets = list(old.weights()) if old is not None else []  # before the swap: nothing after it raises
        self.table.routes[name] = route
        if old is not None:
            gone = [t for t in old_targets if t not in route.weights()]
            old_canary = old.canary.target if old.canary is not None else None
            self.metrics.forget(name, gone, old_canary if old_canary != _canary_target(route) else None)
        self._publish(route, source)
        return route

    def patch(self, name: str, weights: dict[str, float]) -> Route:
        """New weights for some of a route's targets (admin API); stops its canary."""
        route = self.route(name)
        # A target of the route set to 0 needs no model: it is how traffic leaves a version that a
        # reload removed. Targets the patch does not name keep their weights unchecked, so one
        # target down does not block moving traffic between the others.
        checked = [t for t, w in weights.items() if w > 0 or t not in route.targets]
        problems = target_problems(name, checked, self.catalog())
        if problems:
            raise ConfigError("; ".join(problems))
        self._check_ready(name, weights)
        route.set_weights(weights)
        self._publish(route, "admin")
        return route

    def remove(self, name: str) -> None:
        route = self.route(name)
        self.table.remove(name)
        self.metrics.forget(name, list(route.weights()), route.canary.target if route.canary else None)
        log.info("route %s removed", name)

    def _check_ready(self, name: str, weights: Mapping[str, float]) -> None:
        for text, weight in weights.items():
            if weight <= 0:
                continue
            problem = self.readiness(Target.parse(text))
            if problem is not None:
                raise InvalidRequestError(f"route '{name}': target '{text}' cannot take traffic: {problem}")

    def _publish(self, route: Route, source: str) -> None:
        weights = route.weights()
        self.metrics.set_weights(route.name, weights)
        self.metrics.weight_changes.labels(route.name, source).inc()
        if route.canary is not None:
            self.metrics.set_canary_state(route.name, route.canary.target, route.canary.state)
        log.info("route %s: weights %s (%s)", route.name, _rounded(weights), source)

    # ---- canaries ------------------------------------------------------------
    def tick(self) -> list[tuple[Route, Decision]]:
        """Run every canary's due decision; log and export each."""
        decisions = self.table.tick(self.clock())
        for route, decision in decisions:
            assert route.canary is not None  # only canaries decide
            labels = (route.name, route.canary.target)
            if decision.kind == "hold":
                self.metrics.canary_holds.labels(*labels).inc()
                log.info("route %s: canary %s holds at %g%%: %s", *labels, decision.share, decision.reason)
                continue
            if decision.kind == "rollback":
                self.metrics.canary_rollbacks.labels(*labels).inc()
                log.warning("route %s: canary %s rolled back to 0%%: %s", *labels, decision.reason)
            else:
                self.metrics.canary_steps.labels(*labels).inc()
                log.info("route %s: canary %s %s to %g%%: %s", *labels,
                         "completes" if decision.kind == "complete" else "steps", decision.share, decision.reason)
            self._publish(route, "canary")
        return decisions

    # ---- requests ------------------------------------------------------------
    def call(self, name: str | None, key: str | None) -> RouteCall | None:
        """The target of a request to `name`, if `name` is a route."""
        route = self.table.get(name)
        if route is None:
            return None
        return RouteCall(route, route.choose(key), self.metrics)

    def shadow(self, call: RouteCall, run: Callable[[Target], Awaitable[Any]]) -> None:
        """Copy the request to each of the route's shadows (`run(target)` in the background)."""
        for target in call.route.shadows_for():
            labels = (call.route.name, str(target))

            def on_done(error: BaseException | None, seconds: float, labels: tuple[str, str] = labels) -> None:
                outcome = classify(error)
                if outcome == CANCELLED:
                    return  # shut down before it finished: no outcome
                self.metrics.shadow_requests.labels(*labels).inc()
                if outcome == ERROR:  # as for targets, a client error (the copy of a bad request) is not one
                    self.metrics.shadow_errors.labels(*labels).inc()
                    log.debug("shadow %s of route %s failed: %s", labels[1], labels[0], error)
                elif outcome == OK:
                    self.metrics.shadow_latency.labels(*labels).observe(seconds)

            if not self.shadows.dispatch(functools.partial(run, target), on_done):
                self.metrics.shadow_dropped.labels(*labels).inc()

    def describe(self) -> list[dict[str, Any]]:
        return [self.table.routes[name].describe() for name in self.table.names()]

    async def close(self) -> None:
        await self.shadows.close()


def _canary_target(route: Route) -> str | None:
    return route.canary.target if route.canary is not None else None


def _rounded(weights: Mapping[str, float]) -> dict[str, float]:
    return {t: round(w, 3) for t, w in weights.items()}
