"""InlineEstimate: whether a batch runs on the event loop thread.

A batch normally runs on its instance's own thread, so the event loop keeps
serving while the model computes. For a model that answers in microseconds
(a small ONNX graph) the two thread hops cost more than the call itself:
waking the thread, and waking the loop with the result, each a trip through
the OS scheduler, and on a busy machine much more. Such a batch runs inline.

The estimate is the model's recent wall time per row (an exponential average)
times the batch's rows; a batch estimated under `budget_ns` runs inline. The
first call of an instance, with nothing known, runs on its thread, and a call
that turns out slow moves the next ones back.

A call's wall time on the thread overstates what it would cost inline: the
thread also waits for the GIL while the loop runs Python (up to the
interpreter's switch interval, 5 ms, per wait; measured on 2 vCPUs under
load: a 16-row ONNX batch of ~0.2 ms took 2-7 ms there), so a fast model
measured there looks slow and would stay there for good. A thread call may
fit inline when its CPU time on that thread fits the budget and the rest of
its wall time is no more than GIL waits explain (`GIL_WAITS` switch
intervals); a model that waits without the GIL (sleeps, I/O, a GPU) for
longer is never tried inline. Then a later batch runs inline as a probe, and
its wall time, measured where it matters, replaces the estimate. A probe that
does not fit doubles the thread calls before the next one (1, 2, 4 ...
MAX_PROBE_GAP), so a model the CPU time understates (its work on other
threads) stalls the loop once per that many calls at most.
"""
from __future__ import annotations

import sys

# How long one inline call may hold the event loop by default (a model's
# `max_inline_ms`; 0 never runs it inline): a 16-32 row batch of the tabular
# example's ONNX model takes 0.15-0.4 ms there on a loaded 2-vCPU box.
INLINE_BUDGET_NS = 500_000
GIL_WAITS = 2  # switch intervals of waiting a thread call may show and still be tried inline
MAX_PROBE_GAP = 1024  # thread calls between probes, at most
_WEIGHT = 0.2  # of the newest call in the average


class InlineEstimate:
    def __init__(self, budget_ns: int = INLINE_BUDGET_NS):
        self.budget_ns = budget_ns
        self.gil_wait_ns = int(GIL_WAITS * sys.getswitchinterval() * 1e9)
        self._ns_per_row: float | None = None  # wall time
        # The last thread call: CPU time per row, and whether its waits could be the GIL's.
        self._cpu_ns_per_row: float | None = None
        self._waits_explained = False
        self._probe_gap = 1
        self._until_probe = 1  # thread calls left before a probe may run

    def fits(self, rows: int) -> bool:
        return self._estimate_fits(rows) or self._probe_due(rows)

    def record(self, rows: int, elapsed_ns: int) -> None:
        """A call that ran inline took `elapsed_ns` of wall time."""
        per_row = elapsed_ns / max(rows, 1)
        if self._estimate_fits(rows):
            self._average(per_row)
            return
        # A probe (or the first call): its wall time is what an inline call costs.
        self._ns_per_row = per_row
        fitted = per_row * max(rows, 1) < self.budget_ns
        self._probe_gap = 1 if fitted else min(2 * self._probe_gap, MAX_PROBE_GAP)
        self._until_probe = self._probe_gap

    def record_thread(self, rows: int, elapsed_ns: int, cpu_ns: int) -> None:
        """A call that ran on the instance's thread: wall and thread CPU time."""
        self._average(elapsed_ns / max(rows, 1))
        self._cpu_ns_per_row = cpu_ns / max(rows, 1)
        self._waits_explained = elapsed_ns - cpu_ns <= self.gil_wait_ns
        self._until_probe -= 1

    def _estimate_fits(self, rows: int) -> bool:
        return self._ns_per_row is not None and self._ns_per_row * max(rows, 1) < self.budget_ns

    def _probe_due(self, rows: int) -> bool:
        return (self._until_probe <= 0 and self._waits_explained and self._cpu_ns_per_row is not None
                and self._cpu_ns_per_row * max(rows, 1) < self.budget_ns)

    def _average(self, per_row: float) -> None:
        if self._ns_per_row is None or per_row > self.budget_ns:
            self._ns_per_row = per_row  # a slow call counts at once
        else:
            self._ns_per_row += _WEIGHT * (per_row - self._ns_per_row)
