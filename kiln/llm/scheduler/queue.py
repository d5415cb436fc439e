"""The scheduler's waiting queue under a policy: fcfs or priority.

fcfs: arrival order; a preempted request goes back to the front.

priority: a lower `priority` value is served first. Each request gets one
fixed sort key when it arrives,

    key = priority * aging_s + arrival_time      (then arrival order on ties)

so a priority level is worth `aging_s` seconds of waiting. Ordering by this
key is the same as ordering by an effective priority that improves by one
level every `aging_s` seconds a request waits, but it never needs re-sorting.
The starvation bound follows: request A is admitted before every request B
that arrived more than (A.priority - B.priority) * aging_s seconds after A,
so A waits only for the finitely many requests that arrived before
A.arrival + (A.priority - min priority) * aging_s. Equal priorities keep
exactly first-come-first-served. A preempted request keeps its key (it was
early, so it goes back near the front). aging_s == 0 means strict priority
(no aging: the key is (priority, arrival)).
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from kiln.llm.request import Request


def priority_key(request: Request, aging_s: float) -> tuple[float, float, int]:
    """Sort key of a request under the priority policy (smaller goes first)."""
    if aging_s > 0:
        return (request.priority * aging_s + request.arrival_time, 0.0, request.seq)
    return (float(request.priority), request.arrival_time, request.seq)


class WaitingQueue:
    """First-come-first-served; preempted requests return to the front."""

    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._items.append(request)

    def push_preempted(self, request: Request) -> None:
        self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __contains__(self, request: object) -> bool:
        return request in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityWaitingQueue(WaitingQueue):
    """Sorted by `priority_key`; preempted requests go back by their key."""

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s
        self._sorted: list[tuple[tuple[float, float, int], Request]] = []

    def push(self, request: Request) -> None:
        key = priority_key(request, self.aging_s)
        bisect.insort(self._sorted, (key, request), key=lambda entry: entry[0])

    def push_preempted(self, request: Request) -> None:
        self.push(request)

    def peek(self) -> Request:
        return self._sorted[0][1]

    def pop(self) -> Request:
        return self._sorted.pop(0)[1]

    def remove(self, request: Request) -> None:
        for i, (_, r) in enumerate(self._sorted):
            if r is request:
                del self._sorted[i]
                return
        raise ValueError("request is not waiting")

    def __contains__(self, request: object) -> bool:
        return any(r is request for _, r in self._sorted)

    def __len__(self) -> int:
        return len(self._sorted)

    def __bool__(self) -> bool:
        return bool(self._sorted)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in self._sorted)


def make_waiting_queue(policy: str, aging_s: float) -> WaitingQueue:
    return PriorityWaitingQueue(aging_s) if policy == "priority" else WaitingQueue()
