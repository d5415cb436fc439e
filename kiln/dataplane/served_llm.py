"""One LLM engine the server runs: its AsyncLLM, metrics and admission.

States: loading -> ready, loading -> failed, ready -> dead (engine died),
ready -> draining (its model version is being replaced or unloaded).
Only `ready` takes requests; the others answer 503 with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kiln.config import EngineConfig
from kiln.dataplane.load import CountingObserver, RequestTotals, SourceLoad
from kiln.dataplane.usage import UsageObserver
from kiln.errors import EngineDeadError, KilnError, ModelLoadingError, ModelUnavailableError, OverloadedError
from kiln.llm.engine.async_llm import AsyncLLM
from kiln.metrics.cost import UsageTotals
from kiln.metrics.server_metrics import ServerMetrics

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


class ServedLLM:
    def __init__(
        self,
        name: str,
        config: EngineConfig,
        metrics: ServerMetrics,
        *,
        engine_mode: str = "process",
        max_queued_requests: int | None = None,
    ):
        self.name = name
        self.config = config
        self.engine_mode = engine_mode
        self.max_queued_requests = max_queued_requests
        self.engine: AsyncLLM | None = None
        self.load_error: str | None = None
        self.draining = False
        self.metrics = metrics
        self.usage = UsageTotals()  # this engine's busy time, requests and tokens (cost gauges)
        self.totals = RequestTotals()

    @property
    def state(self) -> str:
        if self.load_error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        if self.engine.is_dead:
            return "dead"
        return "draining" if self.draining else "ready"

    async def load(self) -> None:
        try:
            observer = UsageObserver(CountingObserver(self.metrics, self.totals), self.usage)
            self.engine = await AsyncLLM.start(self.config, self.engine_mode, observer=observer)
        except Exception as e:
            self.load_error = e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", self.name, self.load_error)
            raise
        info = self.engine.info
        log.info("model %s ready (max_model_len %d, dtype %s)", self.name, info.max_model_len, info.dtype or "?")

    async def drain_and_shutdown(self, timeout_s: float) -> None:
        """Take no new requests, let in-flight ones finish (up to `timeout_s`), stop the engine."""
        self.draining = True
        engine = self.engine
        if engine is None:
            return
        deadline = time.monotonic() + timeout_s
        while engine.num_in_flight and not engine.is_dead and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if engine.num_in_flight:
            log.warning("model %s: %d requests still running after %.0fs; stopping its engine",
                        self.name, engine.num_in_flight, timeout_s)
        await engine.shutdown()

    def ready_engine(self) -> AsyncLLM:
        """The engine, if it can take requests now; else the 503 that says why."""
        engine = self.engine
        if self.load_error is not None:
            raise EngineDeadError(f"model {self.name!r} failed to load: {self.load_error}")
        if engine is None:
            raise ModelLoadingError(f"model {self.name!r} is still loading")
        if engine.is_dead:
            raise EngineDeadError(f"the engine of model {self.name!r} died: {engine.dead_message}")
        if self.draining:
            raise ModelUnavailableError(f"model {self.name!r} is being replaced or unloaded; retry")
        return engine

    def admit(self, engine: AsyncLLM, num_requests: int) -> None:
        """Refuse at once when the queue (requests with no token yet) is full.

        Something is always admitted into an empty queue, so a request of n
        choices above the limit is not refused forever.
        """
        limit = self.max_queued_requests
        pending = engine.num_pending
        if limit is not None and pending > 0 and pending + num_requests > limit:
            self.metrics.on_rejected()
            self.totals.rejected += num_requests
            raise OverloadedError(
                f"server overloaded: {pending} requests are queued (max_queued_requests={limit}); retry later"
            )

    def current_load(self) -> SourceLoad:
        """Totals since this engine started and its counts now (autoscaling inputs)."""
        engine, totals = self.engine, self.totals
        if engine is None:
            return SourceLoad(key=id(self), rejected=totals.rejected)
        return SourceLoad(
            key=id(self),
            finished=totals.finished,
            rejected=totals.rejected,
            latency_s=totals.latency_s,
            queued=engine.num_pending,
            in_flight=engine.num_in_flight,
            oldest_wait_s=engine.oldest_pending_age(),
        )

    def pids(self) -> dict[str, int | None]:
        """Processes of this engine by role (the engine core, parallel workers)."""
        if self.engine is None:
            return {}
        pids: dict[str, int | None] = {"engine": self.engine.client.engine_pid}
        info = self.engine.info
        for i, pid in enumerate(info.worker_pids if info is not None else []):
            pids[f"worker{i + 1}"] = pid
        return pids
