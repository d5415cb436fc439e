"""Shadow requests: copies run in the background, answers never returned.

A shadow runs as its own task. Whatever it does (fail, hang, get
cancelled) never reaches the caller: the caller does not await it, and its
outcome goes only to `on_done`. At most `max_in_flight` shadows run at once;
a copy beyond that is dropped (counted by the caller through the return
value) rather than queued, so shadows cannot pile up behind a slow target.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 64


class ShadowDispatcher:
    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, clock: Callable[[], float] = time.perf_counter):
        self.max_in_flight = max_in_flight
        self.clock = clock
        self.tasks: set[asyncio.Task] = set()

    def dispatch(
        self, run: Callable[[], Awaitable[object]], on_done: Callable[[BaseException | None, float], None]
    ) -> bool:
        """Start `run()` in the background; False (nothing started) when full.

        `on_done(error, seconds)` gets None on success, else the exception."""
        if len(self.tasks) >= self.max_in_flight:
            return False
        task = asyncio.get_running_loop().create_task(self._run(run, on_done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _run(
        self, run: Callable[[], Awaitable[object]], on_done: Callable[[BaseException | None, float], None]
    ) -> None:
        start = self.clock()
        error: BaseException | None = None
        try:
            await run()
        except asyncio.CancelledError as exc:
            error = exc
            raise
        except Exception as exc:  # noqa: BLE001 - a shadow's failure is only recorded
            error = exc
        finally:
            try:
                on_done(error, self.clock() - start)
            except Exception:  # noqa: BLE001 - recording must not break the loop either
                log.exception("recording a shadow request failed")

    async def close(self) -> None:
        """Cancel every shadow still running (server shutdown)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
