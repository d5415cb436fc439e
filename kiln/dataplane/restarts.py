"""When a dead LLM engine may be started again: backoff and a cap per interval.

The n-th restart inside the window waits `backoff_s * 2**n` seconds (at most
`backoff_max_s`); once `max_restarts` restarts happened inside the last
`window_s` seconds there is none until the oldest leaves the window, so an
engine that dies at once every time is not restarted forever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kiln.config import ServerConfig


@dataclass(frozen=True)
class RestartPolicy:
    """Ranges are checked where the values come from (ServerConfig)."""

    max_restarts: int = 3  # 0: never restart
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    @classmethod
    def of(cls, config: ServerConfig) -> RestartPolicy:
        return cls(config.engine_restarts, config.engine_restart_window_s, config.engine_restart_backoff_s,
                   config.engine_restart_backoff_max_s)


class RestartBudget:
    """The restarts of one engine, against its policy."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.clock = clock
        self._times: deque[float] = deque()

    def next_delay(self) -> float | None:
        """Seconds to wait before the next restart, or None if none is allowed now."""
        now = self.clock()
        while self._times and now - self._times[0] > self.policy.window_s:
            self._times.popleft()
        recent = len(self._times)
        if recent >= self.policy.max_restarts:
            return None
        return min(self.policy.backoff_max_s, self.policy.backoff_s * 2**recent)

    def record(self) -> None:
        """A restart is being attempted now."""
        self._times.append(self.clock())
