"""Progress lines while an engine loads: one log line as each phase begins,
and the seconds each took for the "engine ready" line."""
from __future__ import annotations

import logging
import time


class Progress:
    def __init__(self, log: logging.Logger):
        self.log = log
        self.started = time.perf_counter()
        self.phases: list[tuple[str, float]] = []  # (phase, seconds), in order
        self._current: tuple[str, float] | None = None

    def begin(self, phase: str, detail: str = "") -> None:
        """Ends the current phase and starts `phase` (logged as "loading: <phase> <detail> ...")."""
        self.end()
        self.log.info("loading: %s ...", f"{phase} {detail}" if detail else phase)
        self._current = (phase, time.perf_counter())

    def end(self) -> None:
        if self._current is not None:
            phase, began = self._current
            self.phases.append((phase, time.perf_counter() - began))
            self._current = None

    def total(self) -> float:
        return time.perf_counter() - self.started

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in self.phases)
