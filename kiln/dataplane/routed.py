"""An LLM chosen for an OpenAI request: the engine, and the route call when
the request named a route."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kiln.dataplane.routing.call import RouteCall
from kiln.dataplane.served_llm import ServedLLM

# The response parameter (KServe) naming the target a route sent a request to.
TARGET_PARAMETER = "kiln_route_target"

ShadowLLM = Callable[[RouteCall, Callable[[ServedLLM], Awaitable[Any]]], None]


@dataclass
class ChosenLLM:
    served: ServedLLM
    call: RouteCall | None = None  # None: the request named a model, not a route
    shadow_llm: ShadowLLM | None = None

    @property
    def target(self) -> str | None:
        """`model@version` or `model` the route chose; None without a route."""
        return None if self.call is None else str(self.call.target)

    def model_name(self, report_target: bool = False) -> str:
        """The `model` of the response body: the route's name (or, if asked, the target), else the model's."""
        if self.call is None:
            return self.served.name
        return str(self.call.target) if report_target else self.call.route.name

    def track(self, streams: list[Any]) -> list[Any]:
        """The engine streams of this request, timed for the route's metrics."""
        return streams if self.call is None else self.call.track(streams)

    def fail(self, exc: BaseException) -> None:
        """The request ended with `exc` (recorded once; later streams' ends change nothing)."""
        if self.call is not None:
            self.call.finish(exc)

    def shadow(self, run: Callable[[ServedLLM], Awaitable[Any]]) -> None:
        """Copy the request to the route's shadows: `run(served)` in the background for each."""
        if self.call is not None and self.shadow_llm is not None:
            self.shadow_llm(self.call, run)
