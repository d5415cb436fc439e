"""ServedLLM's drain: no new requests, in-flight ones finish, then the engine stops."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kiln.config import EngineConfig
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import EngineDeadError, ModelLoadingError, ModelUnavailableError
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
