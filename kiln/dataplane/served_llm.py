"""One LLM engine the server runs: its AsyncLLM, metrics, admission and supervision.

States: loading -> ready, loading -> failed, ready -> restarting -> ready
(the engine died and a new one is started, see `restarts.py`), ready -> dead
(it died and no restart is allowed now), ready -> draining (its model
version is being replaced or unloaded). Only `ready` takes requests; the
others answer 503 with the reason. Requests in flight when the engine dies
fail with EngineDeadError; a restart never resumes them.

Admission counts work, not requests: every choice of every prompt is one
engine request. With `max_queued_requests = Q` and the engine's running
capacity `max_num_seqs = S`, an API request of k engine requests is admitted
when the engine then holds at most S + Q unfinished requests (S may run at
once, Q wait), or when it holds none at all. So a burst of up to S + Q
requests is taken whole, and one request can never queue more than S + Q.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kiln.config import EngineConfig
from kiln.dataplane.load import CountingObserver, RequestTotals, SourceLoad
from kiln.dataplane.restarts import RestartBudget, RestartPolicy
from kiln.dataplane.usage import UsageObserver
from kiln.errors import (
    EngineDeadError,
    EngineRestartingError,
    InvalidRequestError,
    KilnError,
    ModelLoadingError,
    ModelUnavailableError,
    OverloadedError,
)
from kiln.llm.engine.async_llm import AsyncLLM
from kiln.metrics.cost import UsageTotals
from kiln.metrics.server_metrics import ServerMetrics
from kiln.serving.repository.embedding import EmbeddingSettings

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
        embedding: EmbeddingSettings | None = None,
        restart_policy: RestartPolicy | None = None,
    ):
        self.name = name
        self.embedding = embedding or EmbeddingSettings()
        self.config = config
        self.engine_mode = engine_mode
        self.max_queued_requests = max_queued_requests
        self.engine: AsyncLLM | None = None
        self.load_error: str | None = None
        self.draining = False
        self._restarting = False
        self.metrics = metrics
        self.usage = UsageTotals()  # this engine's busy time, requests and tokens (cost gauges)
        self.totals = RequestTotals()  # across restarts: the autoscaling inputs of this model version
        self.restarts = RestartBudget(restart_policy or RestartPolicy())
        self._supervisor: asyncio.Task | None = None

    @property
    def restarting(self) -> bool:
        """A new engine is (about to be) started for a dead one."""
        if self._restarting:
            return True
        engine, supervisor = self.engine, self._supervisor
        return (engine is not None and engine.is_dead and not self.draining and supervisor is not None
                and not supervisor.done() and self.restarts.next_delay() is not None)

    @property
    def state(self) -> str:
        if self.load_error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        if self.draining:
            return "draining"
        if self.restarting:
            return "restarting"
        return "dead" if self.engine.is_dead else "ready"

    async def load(self) -> None:
        try:
            self.engine = await self._start_engine()
        except Exception as e:
            self.load_error = e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", self.name, self.load_error)
            raise
        info = self.engine.info
        log.info("model %s ready (max_model_len %d, dtype %s)", self.name, info.max_model_len, info.dtype or "?")
        self._supervisor = asyncio.create_task(self._supervise(), name=f"kiln-supervise-{self.name}")

    async def _start_engine(self) -> AsyncLLM:
        observer = UsageObserver(CountingObserver(self.metrics, self.totals), self.usage)
        return await AsyncLLM.start(self.config, self.engine_mode, observer=observer)

    # ---- supervision ---------------------------------------------------------
    async def _supervise(self) -> None:
        """Restart the engine each time it dies, as the restart policy allows."""
        while True:
            engine = self.engine
            assert engine is not None  # set by load() before this task starts
            reason = await engine.wait_dead()
            self.metrics.on_engine_died()
            if self.draining:
                return
            delay = self.restarts.next_delay()
            if delay is None:
                # After a replacement that failed to start too: dead, not "restarting" for ever
                # (liveness answers 503 on dead, so Kubernetes or Ray replaces the server).
                self._restarting = False
                log.error("model %s: engine died (%s); no restart left (%d in %.0fs); it stays down",
                          self.name, reason, self.restarts.policy.max_restarts, self.restarts.policy.window_s)
                return
            self._restarting = True
            log.warning("model %s: engine died (%s); restarting in %.1fs", self.name, reason, delay)
            await _quietly(engine.shutdown())  # reap what is left of it
            await asyncio.sleep(delay)
            self.restarts.record()
            self.metrics.on_engine_restarting()  # counted as the budget is: killed while loading, it still was one
            new = await self._start_replacement()
            if new is None:
                continue  # it failed to start: counts as another death
            self.engine, self._restarting = new, False
            self.metrics.on_engine_restarted()
            log.warning("model %s: engine restarted", self.name)

    async def _start_replacement(self) -> AsyncLLM | None:
        """A new engine, or None if it failed to start. Never leaves one behind when cancelled."""
        start = asyncio.ensure_future(self._start_engine())
        try:
            return await asyncio.shield(start)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await _quietly((await start).shutdown())
            raise
        except Exception as e:  # noqa: BLE001 - retried within the policy
            log.error("model %s: engine restart failed: %s", self.name, e)
            return None

    async def drain_and_shutdown(self, timeout_s: float) -> None:
        """Take no new requests, let in-flight ones finish (up to `timeout_s`), stop the engine."""
        self.draining = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
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

    # ---- requests ------------------------------------------------------------
    def ready_engine(self) -> AsyncLLM:
        """The engine, if it can take requests now; else the 503 that says why."""
        engine = self.engine
        if self.load_error is not None:
            raise EngineDeadError(f"model {self.name!r} failed to load: {self.load_error}")
        if engine is None:
            raise ModelLoadingError(f"model {self.name!r} is still loading")
        if self.draining:
            raise ModelUnavailableError(f"model {self.name!r} is being replaced or unloaded; retry")
        if self.restarting:
            raise EngineRestartingError(f"the engine of model {self.name!r} died and is restarting; retry shortly")
        if engine.is_dead:
            raise EngineDeadError(f"the engine of model {self.name!r} died: {engine.dead_message}")
        return engine

    def generation_engine(self) -> AsyncLLM:
        """`ready_engine`, for completions and chat (an embedding-only model refuses them)."""
        if self.embedding.embedding_only:
            raise InvalidRequestError(f"model {self.name!r} serves embeddings only (/v1/embeddings)", param="model")
        return self.ready_engine()

    def admit(self, engine: AsyncLLM, num_requests: int) -> None:
        """Refuse at once (503) when `num_requests` more would exceed what the
        engine can run plus what may wait (see the module docstring)."""
        limit = self.max_queued_requests
        if limit is None:
            return
        held = engine.num_in_flight
        capacity = self.config.scheduler.max_num_seqs + limit
        if held > 0 and held + num_requests > capacity:
            self.metrics.on_rejected()
            self.totals.rejected += num_requests
            raise OverloadedError(
                f"server overloaded: the engine holds {held} requests and takes {capacity} "
                f"(max_num_seqs={self.config.scheduler.max_num_seqs} running + max_queued_requests={limit} "
                "waiting); retry later"
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


async def _quietly(shutdown) -> None:
    """Await an engine shutdown, logging (not raising) a failure: the engine is gone either way."""
    try:
        await shutdown
    except Exception:  # noqa: BLE001
        log.exception("stopping a dead engine failed")
