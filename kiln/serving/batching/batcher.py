"""DynamicBatcher: one queue per model version, one worker per instance.

A worker takes the first request in queue order, then keeps taking requests
that can join it (same shapes, or same ranks when padding) until the batch has
max_batch_size rows, hits a preferred size, or the oldest request has waited
max_queue_delay_ms; it leaves earlier when waiting would gather nobody
(`WaitPolicy`: recent waits gathered nobody, or the batch holds as many rows
as were lately outstanding at once). The batch runs on the instance's own
thread, or on the event loop's when the model is fast enough that the
thread hops would cost more (`InlineEstimate`). Such a fast model's request
that finds the queue empty and an instance's worker parked (idle, no batch
in hand) runs at once in the submitting task, as that worker would have run
it alone, without the trip through the queue (`_run_now`).

Invariants:
- every submitted request gets exactly one outcome: a result, its own error,
  a timeout (only while still queued), or cancellation by its caller;
- a request is in `_queue` iff it was submitted and not yet taken/expired;
- the queue never holds more than max_queue_size requests (when > 0).
Models without dynamic batching use the same path with batches of one.

Queue order: by the KServe request parameter `priority` (an integer, lower
first, default 0), aged like the LLM scheduler's priority policy: the sort
key is priority * priority_aging_s + arrival time, so equal priorities stay
first-come-first-served and a request waits only for requests that arrived
before arrival + (its priority - the lowest) * priority_aging_s
(kiln/llm/scheduler/queue.py states the bound).
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import (
    InvalidRequestError,
    KilnError,
    ModelUnavailableError,
    OverloadedError,
    RequestTimeoutError,
    describe,
)
from kiln.serving.batching.concat import same_layout, same_shapes
from kiln.serving.batching.inline import InlineEstimate
from kiln.serving.batching.wait_policy import WaitPolicy
from kiln.serving.metrics import ServingMetrics
from kiln.serving.model import Model
from kiln.serving.parameters import timeout_parameter_s
from kiln.serving.repository.config import RepositoryModelConfig
from kiln.serving.stats import ModelStats
from kiln.serving.types import InferRequest, InferResponse

log = logging.getLogger("kiln.serving.batching")


@dataclass(eq=False)
class _Item:
    request: InferRequest
    rows: int
    future: asyncio.Future
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    timer: asyncio.TimerHandle | None = None
    taken: bool = False
    key: tuple[float, int] = (0.0, 0)  # queue order (see the module docstring)


_arrivals = itertools.count()


def request_priority(request: InferRequest) -> int:
    """The KServe `priority` parameter (lower runs first), 0 when absent."""
    value = request.parameters.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"parameter 'priority' must be an integer, got {value!r}", param="priority")
    return value


class DynamicBatcher:
    def __init__(self, config: RepositoryModelConfig, version: str, instances: list[Model], stats: ModelStats,
                 metrics: ServingMetrics):
        self.config = config
        self.version = version
        self.instances = instances
        self.stats = stats
        self.metrics = metrics
        batching = config.dynamic_batching
        self.batching = batching is not None and config.max_batch_size > 0
        self.max_rows = config.max_batch_size if self.batching else 0
        self.delay_s = batching.max_queue_delay_ms / 1000 if batching else 0.0
        self.preferred = set(batching.preferred_batch_sizes) if batching else set()
        self.pad = bool(batching and batching.variable_shapes == "pad")
        policy = batching or config.queue
        self.max_queue = policy.max_queue_size
        self.default_timeout_s = policy.default_timeout_ms / 1000
        self.aging_s = policy.priority_aging_s
        self._queue: list[_Item] = []  # sorted by _Item.key
        # Workers waiting for the queue to change, woken one per submit (first come first woken).
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._policy = WaitPolicy()
        self._started = False
        self._workers: list[asyncio.Task] = []
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"kiln-{config.name}") for _ in instances]
        self._inline = [InlineEstimate(int(config.max_inline_ms * 1e6)) for _ in instances]
        self._parked: set[int] = set()  # instances whose worker waits for work with no batch in hand
        self._closed = False

    # ------------------------------------------------------------ submit

    def queue_size(self) -> int:
        return len(self._queue)

    def oldest_wait_s(self) -> float:
        """Seconds the oldest queued request has waited (0 when none); the queue is in arrival order."""
        if not self._queue:
            return 0.0
        return (time.perf_counter_ns() - self._queue[0].enqueued_ns) / 1e9

    async def submit(self, request: InferRequest) -> dict[str, np.ndarray]:
        """Queue one validated request and wait for its outputs."""
        if self._closed:
            raise ModelUnavailableError(f"model '{self.config.name}' is unloading")
        self._start()
        if self.max_queue and len(self._queue) >= self.max_queue:
            raise OverloadedError(f"Exceeds maximum queue size ({self.max_queue}) of model '{self.config.name}'")
        priority, timeout = request_priority(request), self._timeout_s(request)  # both checked on every path
        rows = request.batch_size() if self.config.max_batch_size else 1
        self._policy.arrived(rows, time.perf_counter_ns())
        try:
            index = self._instance_for_now(rows)
            if index is not None:
                return self._run_now(index, request, rows)
            return await self._queued(request, priority, timeout, rows)
        finally:
            self._policy.answered(rows)

    async def _queued(self, request: InferRequest, priority: int, timeout: float, rows: int) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        item = _Item(request, rows, loop.create_future())
        item.key = (priority * self.aging_s + item.enqueued_ns / 1e9 if self.aging_s else priority, next(_arrivals))
        if timeout > 0:
            item.timer = loop.call_later(timeout, self._expire, item)
        bisect.insort(self._queue, item, key=_queue_key)
        self._wake_one()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._drop(item)
            raise

    def _instance_for_now(self, rows: int) -> int | None:
        """A parked instance that may run a request of `rows` now, in the caller:
        nothing queued before it, the model fast enough to run inline, and a
        batch of it alone leaving at once (so no batch forms that it would join)."""
        if self._queue or not self._parked:
            return None
        index = next(iter(self._parked))
        if not self._inline[index].fits(rows):
            return None
        if self.batching and not (rows >= self.max_rows or rows in self.preferred or not self._policy.may_wait()
                                  or self._policy.enough(rows, time.perf_counter_ns())):
            return None
        return index

    def _run_now(self, index: int, request: InferRequest, rows: int) -> dict[str, np.ndarray]:
        """Run one request on parked instance `index` without suspending: its
        worker stays parked and cannot take the instance meanwhile."""
        start = time.perf_counter_ns()
        self.stats.queue.add(0)
        results, execute_ns = _timed_execute(self.instances[index], [request])
        self._inline[index].record(rows, execute_ns)
        self._record(self.instances[index], rows, 1, time.perf_counter_ns() - start)
        outcome = self._outcome(results[0])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _timeout_s(self, request: InferRequest) -> float:
        return timeout_parameter_s(request.parameters, self.default_timeout_s)

    def _expire(self, item: _Item) -> None:
        if not item.taken and not item.future.done():
            self._drop(item)
            item.future.set_exception(RequestTimeoutError("Request timeout expired"))

    def _drop(self, item: _Item) -> None:
        if item.timer:
            item.timer.cancel()
        if not item.taken:
            item.taken = True
            with contextlib.suppress(ValueError):
                self._queue.remove(item)

    # ------------------------------------------------------------ workers

    def _start(self) -> None:
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            self._workers = [loop.create_task(self._worker(i)) for i in range(len(self.instances))]

    async def _worker(self, index: int) -> None:
        while True:
            batch = await self._next_batch(index)
            if batch is None:
                return
            try:
                await self._run(self.instances[index], self._executors[index], self._inline[index], batch)
            except Exception as exc:  # noqa: BLE001 - a dead worker would leave the model hanging, still "ready"
                log.exception("model %s: batch failed", self.config.name)
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(_as_kiln_error(self.config.name, exc))

    async def _next_batch(self, index: int) -> list[_Item] | None:
        while not (self._queue or self._closed):
            self._parked.add(index)
            try:
                await self._wait(None)
            finally:
                self._parked.discard(index)
        if not self._queue:
            return None
        batch = [self._take(self._queue[0])]
        if not self.batching:
            return batch
        deadline_ns = batch[0].enqueued_ns + int(self.delay_s * 1e9)
        rows, waited, joined = batch[0].rows, False, False
        may_wait = self._policy.may_wait()
        while True:
            taken = self._take_joining(batch, rows)
            joined = joined or (waited and taken > rows)
            rows = taken
            if rows >= self.max_rows or rows in self.preferred or self._closed:
                return batch
            if not may_wait or self._policy.enough(rows, time.perf_counter_ns()):
                return batch
            remaining_s = (deadline_ns - time.perf_counter_ns()) / 1e9
            if remaining_s <= 0:
                if waited:
                    self._policy.deadline_passed(joined)
                return batch
            await self._wait(remaining_s)
            waited = True

    async def _wait(self, timeout_s: float | None) -> None:
        """Until a submit or stop wakes this worker, or `timeout_s` passes.
        (A bare future and a timer: cheaper than Condition + wait_for, which
        makes a task per wait on Python 3.11.)"""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(timeout_s, _wake, waiter) if timeout_s is not None else None
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_all(self) -> None:
        while self._waiters:
            _wake(self._waiters.popleft())

    def _take(self, item: _Item) -> _Item:
        self._queue.remove(item)
        item.taken = True
        if item.timer:
            item.timer.cancel()
        return item

    def _take_joining(self, batch: list[_Item], rows: int) -> int:
        """Move queued requests that fit the batch into it; return its rows."""
        joins = same_layout if self.pad else same_shapes
        first = batch[0].request
        for item in list(self._queue):
            if rows + item.rows <= self.max_rows and joins(first, item.request):
                batch.append(self._take(item))
                rows += item.rows
        return rows

    async def _run(self, instance: Model, executor: ThreadPoolExecutor, inline: InlineEstimate,
                   batch: list[_Item]) -> None:
        start = time.perf_counter_ns()
        batch = [i for i in batch if not i.future.done()]  # callers that gave up
        if not batch:
            return
        queue_us = self.metrics.child(self.metrics.queue_us, self.config.name, self.version)
        for item in batch:
            self.stats.queue.add(start - item.enqueued_ns)
            queue_us.inc((start - item.enqueued_ns) / 1000)
        requests = [i.request for i in batch]
        rows = sum(i.rows for i in batch)
        if inline.fits(rows):
            results, execute_ns = _timed_execute(instance, requests)
            inline.record(rows, execute_ns)
        else:
            results, execute_ns, cpu_ns = await asyncio.get_running_loop().run_in_executor(
                executor, _timed_execute_on_thread, instance, requests)
            inline.record_thread(rows, execute_ns, cpu_ns)
        self._record(instance, rows, len(batch), time.perf_counter_ns() - start)
        for item, result in zip(batch, results, strict=False):
            if not item.future.done():
                outcome = self._outcome(result)
                if isinstance(outcome, BaseException):
                    item.future.set_exception(outcome)
                else:
                    item.future.set_result(outcome)

    def _record(self, instance: Model, rows: int, requests: int, total_ns: int) -> None:
        timings = instance.timings
        if timings is None:
            input_ns, infer_ns, output_ns = 0, total_ns, 0
        else:
            input_ns, infer_ns = timings.compute_input_ns, timings.compute_infer_ns
            output_ns = timings.compute_output_ns
        self.stats.record_execution(rows, requests, input_ns, infer_ns, output_ns)
        self.metrics.execution(self.config.name, self.version, rows, input_ns, infer_ns, output_ns)

    def _outcome(self, result) -> dict[str, np.ndarray] | KilnError:
        """A request's outputs, or the error its caller gets."""
        if isinstance(result, BaseException):
            return _as_kiln_error(self.config.name, result)
        outputs = result.outputs if isinstance(result, InferResponse) else result
        if not isinstance(outputs, dict):
            return KilnError(f"model '{self.config.name}' returned {type(result).__name__}")
        arrays = {}
        for name, value in outputs.items():
            try:
                arrays[name] = np.asarray(value)
            except Exception as exc:  # noqa: BLE001 - a ragged list, an object numpy cannot read
                return KilnError(f"model '{self.config.name}' returned output '{name}' that is not an array: "
                                 f"{describe(exc)}")
        return arrays

    # ------------------------------------------------------------ stop

    async def stop(self) -> None:
        """Stop the workers; anything still queued fails as unavailable."""
        self._closed = True
        while self._queue:
            item = self._queue.pop(0)
            item.taken = True
            if not item.future.done():
                item.future.set_exception(ModelUnavailableError(f"model '{self.config.name}' was unloaded"))
        if self._started:
            self._wake_all()
            await asyncio.gather(*self._workers, return_exceptions=True)
        for executor in self._executors:
            executor.shutdown(wait=True)


def _timed_execute(instance: Model, requests: list[InferRequest]) -> tuple[list, int]:
    """The model's results (or its exception for every request) and how long the call took."""
    start = time.perf_counter_ns()
    try:
        results = instance.execute(requests)
    except BaseException as exc:  # noqa: BLE001 - the whole call failed; a model's sys.exit() must not reach the loop
        results = [exc] * len(requests)
    return results, time.perf_counter_ns() - start


def _timed_execute_on_thread(instance: Model, requests: list[InferRequest]) -> tuple[list, int, int]:
    """`_timed_execute` plus the CPU time this thread spent (its waits for the GIL excluded)."""
    cpu_start = time.thread_time_ns()
    results, elapsed_ns = _timed_execute(instance, requests)
    return results, elapsed_ns, time.thread_time_ns() - cpu_start


def _queue_key(item: _Item) -> tuple[float, int]:
    return item.key


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _as_kiln_error(model: str, exc: BaseException) -> KilnError:
    if isinstance(exc, KilnError):
        return exc
    return KilnError(f"model '{model}' failed: {describe(exc)}")
