"""WaitPolicy: whether a forming batch waits for more requests.

Waiting (up to max_queue_delay_ms) pays only if requests arrive during the
wait. What the batcher sees tells when they will not:
- a wait that ended at its deadline with nobody joining: the next batches
  leave at once, 1, 2, 4 ... up to MAX_SKIP of them after consecutive
  fruitless waits (one client that sends its next request only after each
  answer would otherwise pay the full delay every time, and a slow stream of
  independent requests still gets a wait now and then to find out);
- a request that arrives while another is outstanding: requests overlap,
  waiting is on again at once;
- a batch that holds as many rows as were lately outstanding at once
  (`RecentPeak`, when above one): clients that wait for their answers before
  sending again cannot send more, so it leaves.
"""
from __future__ import annotations

# One fruitless wait (max_queue_delay_ms) per this many batches at most: with one
# client in a loop on a fast model (~2,600 requests/s over HTTP, 2 ms delay) the
# probes cost ~1% of its rate (3% at 256).
MAX_SKIP = 1024


class RecentPeak:
    """The largest value observed over the current window and the one before
    it: a burst is forgotten after one to two windows."""

    def __init__(self, window_ns: int = 1_000_000_000):
        self.window_ns = window_ns
        self._start_ns = 0
        self._current = 0
        self._previous = 0

    def observe(self, value: int, now_ns: int) -> None:
        self._roll(now_ns)
        self._current = max(self._current, value)

    def peak(self, now_ns: int) -> int:
        self._roll(now_ns)
        return max(self._current, self._previous)

    def _roll(self, now_ns: int) -> None:
        elapsed = now_ns - self._start_ns
        if elapsed < self.window_ns:
            return
        # The window that just ended counts only if it ended less than a window ago.
        self._previous = self._current if elapsed < 2 * self.window_ns else 0
        self._current = 0
        self._start_ns = now_ns


class WaitPolicy:
    def __init__(self) -> None:
        self.outstanding_rows = 0  # submitted, not yet answered
        self._skip = 0  # batches that leave without waiting, after fruitless waits
        self._backoff = 1
        self._peak = RecentPeak()

    def arrived(self, rows: int, now_ns: int) -> None:
        if self.outstanding_rows > 0:
            self._skip, self._backoff = 0, 1
        self.outstanding_rows += rows
        self._peak.observe(self.outstanding_rows, now_ns)

    def answered(self, rows: int) -> None:
        self.outstanding_rows -= rows

    def may_wait(self) -> bool:
        """Asked once per batch."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def enough(self, rows: int, now_ns: int) -> bool:
        peak = self._peak.peak(now_ns)
        return peak > 1 and rows >= peak

    def deadline_passed(self, joined_while_waiting: bool) -> None:
        if joined_while_waiting:
            self._skip, self._backoff = 0, 1
        else:
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, MAX_SKIP)
