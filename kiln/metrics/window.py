"""Differences of cumulative readings over a sliding window of time.

Readings map a key (a model version, a process) to cumulative counters
(busy seconds, requests, CPU seconds, ...). `add` keeps snapshots; `deltas`
subtracts the snapshot that opens the window from readings taken now.

Invariant: the first kept snapshot is the newest one at least `window_s`
old (once there is one), so a window spans `window_s` up to `window_s` plus
one sampling interval; until the server has run that long it spans what
there is. A key absent from that snapshot (new since), or whose counters
went down (its model version reloaded, its process restarted), counts from
zero: all it has done lies inside the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

Reading = Mapping[Any, tuple[float, ...]]  # key: any hashable


class SlidingWindow:
    def __init__(self, window_s: float):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.samples: deque[tuple[float, dict[Any, tuple[float, ...]]]] = deque()

    def add(self, now: float, reading: Reading) -> None:
        self.samples.append((now, dict(reading)))
        while len(self.samples) >= 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()

    def deltas(self, now: float, reading: Reading) -> tuple[float, dict[Any, tuple[float, ...]]]:
        """(span in seconds, {key: counters now minus at the window's start})."""
        if not self.samples:
            return 0.0, {}
        start, base = self.samples[0]
        out = {}
        for key, values in reading.items():
            old = base.get(key)
            if old is None or len(old) != len(values) or any(v < o for v, o in zip(values, old, strict=True)):
                out[key] = tuple(values)
            else:
                out[key] = tuple(v - o for v, o in zip(values, old, strict=True))
        return max(0.0, now - start), out
