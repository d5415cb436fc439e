"""ServedLLM: the drain (no new requests, in-flight ones finish, then the engine
stops), supervision (a dead engine is restarted within the policy) and
admission (work, not requests, against running capacity + queue)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from kiln.config import EngineConfig
from kiln.dataplane.restarts import RestartBudget, RestartPolicy
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import (
    EngineDeadError,
    EngineRestartingError,
    ModelLoadingError,
    ModelUnavailableError,
    OverloadedError,
)
from kiln.metrics.server_metrics import LLMMetricFamilies, ServerMetrics


class FakeEngine:
    """What ServedLLM reads of an AsyncLLM while draining."""

    def __init__(self, in_flight: int):
        self.num_in_flight = in_flight
        self.is_dead = False
        self.dead_message = None
        self.stopped = False

    async def shutdown(self) -> None:
        self.stopped = True


def served_with(engine: FakeEngine | None) -> ServedLLM:
    metrics = ServerMetrics(LLMMetricFamilies(CollectorRegistry()), "m")
    served = ServedLLM("m", EngineConfig(), metrics)
    served.engine = engine  # what load() sets once AsyncLLM.start returns
    return served


def test_drain_waits_for_in_flight_requests_then_stops_the_engine():
    async def main():
        engine = FakeEngine(in_flight=2)
        served = served_with(engine)
        assert served.ready_engine() is engine
        drain = asyncio.create_task(served.drain_and_shutdown(timeout_s=10))
        await asyncio.sleep(0.2)
        stopped_early, state = engine.stopped, served.state
        with pytest.raises(ModelUnavailableError, match="replaced or unloaded"):
            served.ready_engine()
        engine.num_in_flight = 0
        await asyncio.wait_for(drain, 5)
        return stopped_early, state, engine.stopped

    assert asyncio.run(main()) == (False, "draining", True)


def test_drain_stops_the_engine_at_the_timeout_even_with_requests_left():
    async def main():
        engine = FakeEngine(in_flight=1)
        await asyncio.wait_for(served_with(engine).drain_and_shutdown(timeout_s=0.1), 5)
        return engine.stopped

    assert asyncio.run(main())


def test_states_and_their_errors():
    served = served_with(None)
    assert served.state == "loading"
    with pytest.raises(ModelLoadingError):
        served.ready_engine()
    engine = FakeEngine(in_flight=0)
    served.engine = engine
    engine.is_dead, engine.dead_message = True, "killed"
    assert served.state == "dead"
    with pytest.raises(EngineDeadError, match="killed"):
        served.ready_engine()


# ---- supervision: a dead engine is restarted, within the policy --------------


class DyingEngine(FakeEngine):
    """An engine that dies when told to (what AsyncLLM does when its process goes)."""

    def __init__(self):
        super().__init__(in_flight=0)
        self._dead = asyncio.Event()
        self.max_model_len = 64
        # the part of the engine's Ready message ServedLLM logs at load
        self.info = SimpleNamespace(max_model_len=64, dtype="float32", worker_pids=[])

    def die(self, message: str = "killed") -> None:
        self.is_dead, self.dead_message = True, message
        self._dead.set()

    async def wait_dead(self) -> str:
        await self._dead.wait()
        return self.dead_message


def supervised(policy: RestartPolicy, fail_starts: int = 0) -> tuple[ServedLLM, list[DyingEngine]]:
    """A ServedLLM whose engines are DyingEngines; the first `fail_starts` restarts fail."""
    served = served_with(None)
    served.restarts = RestartBudget(policy)
    started: list[DyingEngine] = []
    failures = [fail_starts]

    async def start_engine():
        if started and failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("cannot start")
        started.append(DyingEngine())
        return started[-1]

    served._start_engine = start_engine  # type: ignore[method-assign]
    return served, started


async def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def restarts_counted(served: ServedLLM) -> float:
    return served.metrics.engine_restarts._value.get()


def test_a_dead_engine_is_restarted_and_serves_again():
    async def main():
        served, engines = supervised(RestartPolicy(max_restarts=3, backoff_s=0.05))
        await served.load()
        engines[0].die()
        await wait_for(lambda: served.state == "restarting")
        with pytest.raises(EngineRestartingError) as e:
            served.ready_engine()
        assert e.value.http_status == 503 and e.value.retry_after_s
        await wait_for(lambda: served.state == "ready")
        assert served.ready_engine() is engines[1] and engines[0].stopped  # the old one reaped
        assert restarts_counted(served) == 1
        await served.drain_and_shutdown(1)
        return engines[1].stopped

    assert asyncio.run(main())


def test_restarts_stop_at_the_cap_and_the_engine_stays_dead():
    async def main():
        served, engines = supervised(RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.01))
        await served.load()
        for i in range(2):
            engines[i].die()
            await wait_for(lambda i=i: len(engines) == i + 2 and served.state == "ready")
        served.metrics.running.set(3)  # the last readings of the engine about to die
        served.metrics.waiting.set(2)
        served.metrics.kv_usage.set(0.5)
        engines[2].die()
        await asyncio.sleep(0.1)
        assert len(engines) == 3 and served.state == "dead" and restarts_counted(served) == 2
        gauges = (served.metrics.running, served.metrics.waiting, served.metrics.kv_usage)
        assert [g._value.get() for g in gauges] == [0, 0, 0]  # a dead engine runs and holds nothing
        with pytest.raises(EngineDeadError):
            served.ready_engine()
        await served.drain_and_shutdown(1)

    asyncio.run(main())


def test_a_failed_restart_counts_and_is_retried():
    async def main():
        served, engines = supervised(RestartPolicy(max_restarts=3, backoff_s=0.01), fail_starts=1)
        await served.load()
        engines[0].die()
        await wait_for(lambda: served.state == "ready" and len(engines) == 2)
        assert len(served.restarts._times) == 2  # the failed attempt and the one that worked
        assert restarts_counted(served) == 2  # the metric counted 1: replacements that failed were missing
        await served.drain_and_shutdown(1)

    asyncio.run(main())


def test_a_replacement_that_fails_to_start_with_no_restart_left_leaves_the_model_dead():
    # It stayed "restarting" for ever: liveness kept answering 200 and nothing replaced the server.
    async def main():
        served, engines = supervised(RestartPolicy(max_restarts=1, backoff_s=0.01), fail_starts=1)
        await served.load()
        engines[0].die()
        await asyncio.sleep(0.2)
        state = served.state
        await served.drain_and_shutdown(1)
        return state

    assert asyncio.run(main()) == "dead"


def test_no_restart_while_draining():
    async def main():
        served, engines = supervised(RestartPolicy(max_restarts=3, backoff_s=0.01))
        await served.load()
        drain = asyncio.create_task(served.drain_and_shutdown(1))
        await asyncio.sleep(0.01)
        engines[0].die()
        await drain
        await asyncio.sleep(0.05)
        return len(engines)

    assert asyncio.run(main()) == 1


def test_backoff_doubles_within_the_window_and_resets_after_it():
    now = [0.0]
    budget = RestartBudget(RestartPolicy(max_restarts=3, window_s=100, backoff_s=1, backoff_max_s=3), lambda: now[0])
    delays = []
    for _ in range(3):
        delays.append(budget.next_delay())
        budget.record()
    assert delays == [1, 2, 3] and budget.next_delay() is None
    now[0] = 101.0
    assert budget.next_delay() == 1
    assert RestartBudget(RestartPolicy(max_restarts=0)).next_delay() is None


# ---- admission: work counted against running capacity + queue ---------------


def admitting(max_num_seqs: int, max_queued: int | None) -> ServedLLM:
    metrics = ServerMetrics(LLMMetricFamilies(CollectorRegistry()), "m")
    config = EngineConfig.from_flat(max_num_seqs=max_num_seqs)
    return ServedLLM("m", config, metrics, max_queued_requests=max_queued)


def test_a_burst_is_admitted_up_to_running_capacity_plus_queue():
    served = admitting(max_num_seqs=128, max_queued=8)
    engine = FakeEngine(in_flight=0)
    admitted = 0
    for _ in range(100):  # 100 concurrent one-choice requests, room for 128 running
        served.admit(engine, 1)
        engine.num_in_flight += 1
        admitted += 1
    assert admitted == 100
    engine.num_in_flight = 136
    with pytest.raises(OverloadedError, match="max_queued_requests=8"):
        served.admit(engine, 1)


def test_a_large_request_is_admitted_whole_or_not_at_all():
    served = admitting(max_num_seqs=4, max_queued=2)
    engine = FakeEngine(in_flight=3)
    served.admit(engine, 3)  # 6 of 6
    with pytest.raises(OverloadedError):
        served.admit(engine, 4)  # 7 > 6
    served.admit(FakeEngine(in_flight=0), 50)  # an idle engine takes anything (the per-request cap bounds it)
    admitting(max_num_seqs=1, max_queued=None).admit(FakeEngine(in_flight=10**6), 10)  # no queue limit
