"""Progress on the terminal (a rich progress bar with an ETA) and Ctrl-C.

The bar counts load levels: each configuration plans every level, and a
sweep that stops early (or a configuration that cannot be served) advances
the bar by the levels it skipped, so the ETA tracks the measurements left.
Every measured point is also printed as one line (kept in logs when the
output is not a terminal).

The first Ctrl-C asks the run to stop after the point being measured: its
server is stopped and the report of what was measured is written. A second
Ctrl-C stops at once (the server is still stopped on the way out).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

from kiln.analyze.objective import Objective, Point
from kiln.analyze.space import Config
from kiln.analyze.sweep import ConfigResult


class StopFlag:
    def __init__(self) -> None:
        self.requested = False
        self.on_request: list = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopFlag]:
        """SIGINT or SIGTERM sets the flag (the run stops after the current point, writes its
        report and stops its server); a second one raises KeyboardInterrupt. Without the
        SIGTERM handler a `kill` or a CI timeout left the server it started running."""

        def handle(signum: int, frame: FrameType | None) -> None:
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            for callback in self.on_request:
                callback()

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def describe_config(config: Config, base: Config) -> str:
    changed = {k: v for k, v in config.items() if base.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "base"


class Progress:
    def __init__(self, base: Config, level_name: str, enabled: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self.base = base
        self.level_name = level_name
        self.console = Console(stderr=True, quiet=not enabled, soft_wrap=True)
        self.bar = RichProgress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("levels"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.task = self.bar.add_task("analyzing", total=None)
        self.configs = 0

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def plan(self, levels: int) -> None:
        """Add `levels` to the measurements expected."""
        task = self.bar.tasks[0]
        self.bar.update(self.task, total=(task.total or 0) + levels)

    def _ensure_total(self, more: int) -> None:
        task = self.bar.tasks[0]
        if task.total is None or task.completed + more > task.total:
            self.bar.update(self.task, total=task.completed + more)

    def note(self, text: str) -> None:
        self.bar.update(self.task, description=text.replace("[", "\\["))

    def point(self, config: Config, point: Point, objective: Objective, cached: bool = False) -> None:
        self._ensure_total(1)
        self.bar.advance(self.task)
        latency = (f"p99 TTFT {point.ttft_p99_ms or 0:.0f} ms, p99 TPOT {point.tpot_p99_ms or 0:.1f} ms"
                   if objective.kind == "llm" else f"p99 {point.p99_ms:.1f} ms")
        errors = f", {point.errors} errors" if point.errors else ""
        self.console.print(
            f"  [{describe_config(config, self.base)}] {self.level_name} {point.level:g}: "
            f"{objective.throughput(point):.1f} {objective.unit}, {latency}{errors}"
            + (" (measured earlier)" if cached else ""), highlight=False, markup=False,
        )
        self.note(f"config {self.configs + 1}: {describe_config(config, self.base)}")

    def config_done(self, config: Config, result: ConfigResult | None, invalid: str | None, skipped: int) -> None:
        self.configs += 1
        if skipped > 0:
            self._ensure_total(skipped)
            self.bar.advance(self.task, skipped)
        what = describe_config(config, self.base)
        if invalid:
            self.console.print(f"[{what}] not servable: {invalid}", highlight=False, markup=False)
        elif result is not None:
            best = f"{result.score:.1f} at {result.best.level:g}" if result.best is not None else "no level in SLO"
            self.console.print(f"[{what}] {best} ({result.stop_reason})", highlight=False, markup=False)
