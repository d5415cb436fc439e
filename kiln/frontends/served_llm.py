"""One LLM the server serves: its engine (once loaded), metrics and admission.

States: loading -> ready, loading -> failed, ready -> dead (engine died).
Only `ready` takes requests; the others answer 503 with the reason.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prometheus_client import CollectorRegistry

from kiln.config import EngineConfig
from kiln.errors import EngineDeadError, KilnError, OverloadedError
from kiln.frontends.errors import ModelLoadingError
from kiln.llm.engine.async_llm import AsyncLLM
from kiln.metrics.process import ProcessCollector
from kiln.metrics.server_metrics import ServerMetrics

log = logging.getLogger(__name__)


def default_model_name(config: EngineConfig) -> str:
    """The model file's or directory's name, without a .gguf suffix."""
    from kiln.llm.models.default_model import resolve_model_path

    path = Path(resolve_model_path(config))
    return path.stem if path.suffix == ".gguf" else path.name


class ServedLLM:
    def __init__(
        self,
        name: str,
        config: EngineConfig,
        registry: CollectorRegistry,
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
        self.metrics = ServerMetrics(registry, name)
        registry.register(ProcessCollector(name, self._pids))

    @property
    def state(self) -> str:
        if self.load_error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        return "dead" if self.engine.is_dead else "ready"

    async def load(self) -> None:
        try:
            self.engine = await AsyncLLM.start(self.config, self.engine_mode, observer=self.metrics)
        except Exception as e:
            self.load_error = e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", self.name, self.load_error)
            raise
        log.info("model %s ready (max_model_len %d)", self.name, self.engine.max_model_len)

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()

    def ready_engine(self) -> AsyncLLM:
        """The engine, if it can take requests now; else the 503 that says why."""
        state = self.state
        if state == "loading":
            raise ModelLoadingError(f"model {self.name!r} is still loading")
        if state == "failed":
            raise EngineDeadError(f"model {self.name!r} failed to load: {self.load_error}")
        if state == "dead":
            raise EngineDeadError(f"the engine of model {self.name!r} died: {self.engine.dead_message}")
        return self.engine

    def admit(self, engine: AsyncLLM, num_requests: int) -> None:
        """Refuse at once when the queue (requests with no token yet) is full.

        Something is always admitted into an empty queue, so a request of n
        choices above the limit is not refused forever.
        """
        limit = self.max_queued_requests
        pending = engine.num_pending
        if limit is not None and pending > 0 and pending + num_requests > limit:
            self.metrics.on_rejected()
            raise OverloadedError(
                f"server overloaded: {pending} requests are queued (max_queued_requests={limit}); retry later"
            )

    def _pids(self) -> dict[str, int | None]:
        engine_pid = self.engine.client.engine_pid if self.engine else None
        return {"api": os.getpid(), "engine": engine_pid}
