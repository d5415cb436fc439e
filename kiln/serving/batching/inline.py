"""InlineEstimate: whether a batch runs on the event loop thread.

A batch normally runs on its instance's own thread, so the event loop keeps
serving while the model computes. For a model that answers in microseconds
(a small ONNX graph) the two thread hops cost more than the call itself:
waking the thread, and waking the loop with the result, each a trip through
the OS scheduler, and on a busy machine much more. Such a batch runs inline.

The estimate is the model's recent time per row (an exponential average over
every call, inline or not) times the batch's rows; a batch estimated under
`budget_ns` runs inline. The first call of an instance, with nothing known,
runs on its thread, and a call that turns out slow moves the next ones back.
"""
from __future__ import annotations

INLINE_BUDGET_NS = 150_000  # how long one inline call may hold the event loop
_WEIGHT = 0.2  # of the newest call in the average


class InlineEstimate:
    def __init__(self, budget_ns: int = INLINE_BUDGET_NS):
        self.budget_ns = budget_ns
        self._ns_per_row: float | None = None

    def fits(self, rows: int) -> bool:
        return self._ns_per_row is not None and self._ns_per_row * max(rows, 1) < self.budget_ns

    def record(self, rows: int, elapsed_ns: int) -> None:
        per_row = elapsed_ns / max(rows, 1)
        if self._ns_per_row is None or per_row > self.budget_ns:
            self._ns_per_row = per_row  # a slow call counts at once
        else:
            self._ns_per_row += _WEIGHT * (per_row - self._ns_per_row)
