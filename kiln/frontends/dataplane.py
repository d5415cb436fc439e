"""DataPlane: the one object every transport (OpenAI HTTP, KServe v2) talks to.

It holds the served models, the metrics registry, and the server's state
(draining or not). Routers look models up here and never hold their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from kiln.config import EngineConfig
from kiln.errors import ModelNotFoundError
from kiln.frontends.errors import DrainingError
from kiln.frontends.served_llm import ServedLLM, default_model_name
from kiln.frontends.settings import ServerSettings
from kiln.metrics.device import DeviceCollector

log = logging.getLogger(__name__)


class DataPlane:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.registry = CollectorRegistry()  # per server: several servers in one process never clash
        self.device_metrics = DeviceCollector(model_name="")
        if self.device_metrics.available:
            self.registry.register(self.device_metrics)
        self.llms: dict[str, ServedLLM] = {}
        self.draining = False
        self.on_fatal: Callable[[str], None] | None = None  # e.g. stop the server when a load fails
        self.repository = None  # kiln.serving DataPlane when a model repository is served
        self._grpc_server = None

    def add_llm(self, config: EngineConfig, name: str | None = None) -> ServedLLM:
        name = name or self.settings.served_model_name or default_model_name(config)
        if name in self.llms:
            raise ValueError(f"model name {name!r} is served twice")
        self.device_metrics.model_name = self.device_metrics.model_name or name
        served = ServedLLM(
            name,
            config,
            self.registry,
            engine_mode=self.settings.engine_mode,
            max_queued_requests=self.settings.max_queued_requests,
        )
        self.llms[name] = served
        return served

    def llm(self, name: str | None) -> ServedLLM:
        """The model a request names (None: the first served one)."""
        if self.draining:
            raise DrainingError("the server is shutting down and accepts no new requests")
        if name is None and self.llms:
            return next(iter(self.llms.values()))
        served = self.llms.get(name) if name is not None else None
        if served is None:
            raise ModelNotFoundError(
                f"model {name!r} does not exist; this server serves {sorted(self.llms)}", param="model"
            )
        return served

    def attach_repository(self, repository) -> None:
        """Also serve a KServe v2 model repository (kiln.serving DataPlane)."""
        self.repository = repository
        self.registry.register(_RegistryBridge(repository.metrics.registry))

    def health(self) -> tuple[bool, dict[str, str]]:
        states = {name: served.state for name, served in self.llms.items()}
        if self.repository is not None:
            states["model_repository"] = "ready" if self.repository.started else "loading"
        ok = not self.draining and bool(states) and all(s == "ready" for s in states.values())
        return ok, states

    async def start(self) -> None:
        """Load every LLM (concurrently), then the repository; report the
        first LLM failure as fatal. A repository model that fails to load is
        logged and the others serve (Triton's behaviour)."""
        results = await asyncio.gather(*(s.load() for s in self.llms.values()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and self.on_fatal is not None:
            self.on_fatal(str(errors[0]))
            return
        if self.repository is not None:
            await self._start_repository()

    async def _start_repository(self) -> None:
        from kiln.frontends.kserve.grpc.servicer import start_grpc_server
        from kiln.serving.backends.llm import share_engine

        loop = asyncio.get_running_loop()
        for name, served in self.llms.items():
            if served.engine is not None:
                share_engine(name, served.engine, loop)
        for name, message in (await self.repository.start()).items():
            log.error("repository model %s is unavailable: %s", name, message)
        if self.settings.grpc_port >= 0:
            self._grpc_server = await start_grpc_server(self.repository, self.settings.host, self.settings.grpc_port)
            log.info("KServe v2 gRPC on %s:%d", self.settings.host, self._grpc_server.bound_port)

    async def shutdown(self) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=5)
        if self.repository is not None:
            await self.repository.stop()
        await asyncio.gather(*(s.shutdown() for s in self.llms.values()), return_exceptions=True)


class _RegistryBridge:
    """Exposes another CollectorRegistry's metrics through this one."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        return self._registry.collect()
