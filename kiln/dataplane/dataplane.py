"""DataPlane: the one object every transport (OpenAI HTTP, KServe v2 HTTP and
gRPC) talks to.

It owns every served model through one ModelManager: the model repository's
models and the LLMs given on the command line (added in memory), each LLM
version running on its own engine (`llm_model.LLMModel`). It also owns the
server's metrics registry and its state (draining or not). Transports decode
their wire format, call these methods and encode what comes back; every
answer and every error (a KilnError) comes from here, so all transports
behave the same. Nothing here is global: two servers in one process share
no state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any

from prometheus_client import CollectorRegistry

from kiln.config import EngineConfig, ServerConfig, flat_options
from kiln.dataplane.autoscale import AutoscaleMonitor
from kiln.dataplane.llm_model import LLMModel
from kiln.dataplane.load import SourceLoad, version_load
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import DrainingError, InvalidRequestError, ModelNotFoundError
from kiln.metrics.desired_replicas import HintConfig
from kiln.metrics.device import DeviceCollector
from kiln.metrics.process import ProcessCollector
from kiln.metrics.server_metrics import LLMMetricFamilies
from kiln.serving.codecs.kserve_http import decode_json
from kiln.serving.codecs.limits import Limits
from kiln.serving.metrics import ServingMetrics
from kiln.serving.repository.config import RepositoryModelConfig
from kiln.serving.repository.manager import ModelManager
from kiln.serving.repository.version import LoadedVersion
from kiln.serving.stats import ModelStats
from kiln.serving.types import InferRequest, InferResponse

log = logging.getLogger(__name__)


class DataPlane:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.limits = Limits(max_body_bytes=config.max_tensor_request_bytes)
        self.registry = CollectorRegistry()  # per server: several servers in one process never clash
        self.llm_metrics = LLMMetricFamilies(self.registry)
        self.models = ModelManager(
            config.model_repository, ServingMetrics(self.registry), backends={"llm": self._new_llm_model}
        )
        self.registry.register(ProcessCollector(self._pids))
        self.device_metrics = DeviceCollector(model_name="")
        if self.device_metrics.available:
            self.registry.register(self.device_metrics)
        self.autoscale = AutoscaleMonitor(self.loads, hint_config(config))
        self.registry.register(self.autoscale)
        self._sampling: asyncio.Task | None = None
        self.command_line_models: list[str] = []  # their load failure stops the server
        self.draining = False
        self.started = False

    def _new_llm_model(self) -> LLMModel:
        return LLMModel(
            self.llm_metrics,
            engine_mode=self.config.engine_mode,
            max_queued_requests=self.config.max_queued_requests,
            drain_timeout_s=self.config.shutdown_timeout,
        )

    def add_llm(self, config: EngineConfig, name: str) -> None:
        """Serve an LLM given on the command line (loaded by `start`)."""
        self.models.add_model({"backend": "llm", "parameters": flat_options(config)}, name)
        self.command_line_models.append(name)
        self.device_metrics.model_name = self.device_metrics.model_name or name

    # ---- life cycle ----------------------------------------------------------
    async def start(self) -> dict[str, str]:
        """Load every model; returns {model: error} for those that failed."""
        if self._sampling is None:
            self._sampling = asyncio.create_task(self.autoscale.run())
        errors = await self.models.load_all()
        for name, message in errors.items():
            log.error("model %s is unavailable: %s", name, message)
        self.started = True
        return errors

    async def shutdown(self) -> None:
        if self._sampling is not None:
            self._sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampling
            self._sampling = None
        await self.models.close()

    # ---- health --------------------------------------------------------------
    def live(self) -> bool:
        """False once an engine died: it never comes back in this process, so it must restart."""
        return "dead" not in self.model_states().values()

    def model_states(self) -> dict[str, str]:
        """Every model's state: ready, loading, unavailable, unloading, dead (an LLM engine died)."""
        states = {}
        for row in self.models.index():
            if row.get("reason") == "unloaded":
                continue
            name = row["name"]
            state = row["state"].lower() if "state" in row else ("unavailable" if self.started else "loading")
            if state == "ready" and not self.models.resolve(name).healthy():
                state = "dead"
            states[name] = state
        return states

    def ready(self) -> bool:
        if not self.started or self.draining:
            return False
        states = self.model_states()
        required = states if self.config.strict_readiness else {n: states.get(n, "") for n in self.command_line_models}
        return all(s == "ready" for s in required.values())

    # ---- OpenAI: LLMs by name ------------------------------------------------
    def llm_names(self) -> list[str]:
        """Models served by the LLM engine, in the order requests default to them."""
        names = [n for n in self.models.names() if self._is_llm(n)]
        return sorted(names, key=lambda n: (n not in self.command_line_models, n))

    def _is_llm(self, name: str) -> bool:
        config = self.models.source_config(name)
        return config is not None and config.backend == "llm"

    def llm(self, name: str | None) -> ServedLLM:
        """The LLM a request names (None: the first one), ready or the error that says why not."""
        if self.draining:
            raise DrainingError("the server is shutting down and accepts no new requests")
        names = self.llm_names()
        if name is None and names:
            name = names[0]
        if name is None or name not in names:
            raise ModelNotFoundError(f"model {name!r} does not exist; this server serves {names}", param="model")
        model = self.models.resolve(name).async_model
        if not isinstance(model, LLMModel) or model.served is None:
            raise InvalidRequestError(f"model {name!r} is not an LLM", param="model")
        return model.served

    def loaded_llm(self, name: str) -> ServedLLM | None:
        """The LLM serving `name` now, or None while it is not loaded."""
        config = self.models.config_of(name)
        if config is None:
            return None
        model = self.models.resolve(name).async_model
        return model.served if isinstance(model, LLMModel) else None

    # ---- KServe v2 -----------------------------------------------------------
    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            loaded = self.models.resolve(name, version)
        except InvalidRequestError:
            raise
        except Exception:  # noqa: BLE001 - unknown or unavailable = not ready
            return False
        return loaded.healthy()

    def model_config(self, name: str, version: str = "") -> RepositoryModelConfig:
        return self.models.resolve(name, version).config

    def model_versions(self, name: str) -> list[int]:
        return sorted(self.models.entry(name).versions)

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if name and version:
            return [self.models.resolve(name, version).stats]
        if name:
            self.models.resolve(name)  # unknown or unavailable: the error says which
            entry = self.models.entry(name)
            return [entry.versions[v].stats for v in sorted(entry.versions)]
        stats = []
        for row in self.models.index(ready_only=True):
            loaded = self.models.entry(row["name"]).versions.get(int(row["version"]))
            if loaded is not None:
                stats.append(loaded.stats)
        return stats

    async def infer(self, request: InferRequest) -> InferResponse:
        self._refuse_if_draining()
        loaded, outputs = await self.models.infer(request)
        return InferResponse(request.model_name, str(loaded.version), outputs, id=request.id)

    async def stream_infer(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """The responses of one request: several when the model streams it, else one."""
        self._refuse_if_draining()
        loaded = self.models.resolve(request.model_name, request.model_version)
        async for response in loaded.stream(request):
            response.model_version = str(loaded.version)
            yield response

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise DrainingError("the server is shutting down and accepts no new requests")

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return self.models.index(ready_only)

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        override = None
        for key, value in (parameters or {}).items():
            if key == "config":
                override = _parse_override(value, self.limits)
            elif key.startswith("file:"):
                raise InvalidRequestError("model file overrides ('file:' parameters) are not supported")
            else:
                raise InvalidRequestError(f"unknown load parameter '{key}'")
        await self.models.load(name, override)

    async def unload_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        parameters = parameters or {}
        unknown = set(parameters) - {"unload_dependents"}
        if unknown:
            raise InvalidRequestError(f"unknown unload parameter(s) {sorted(unknown)}")
        await self.models.unload(name, bool(parameters.get("unload_dependents", False)))

    # ---- metrics -------------------------------------------------------------
    def loads(self) -> dict[str, list[SourceLoad]]:
        """Every loaded model's load now: per version, its LLM engine's or its own."""
        loaded = self.models.loaded_versions()
        return {name: [_version_source(v) for v in versions] for name, versions in loaded.items()}

    def _pids(self) -> dict[tuple[str, str], int | None]:
        pids: dict[tuple[str, str], int | None] = {}
        for name in self.llm_names():
            served = self.loaded_llm(name)
            pids[(name, "api")] = os.getpid()
            for role, pid in (served.pids() if served is not None else {}).items():
                pids[(name, role)] = pid
        return pids or {("", "api"): os.getpid()}


def _version_source(version: LoadedVersion) -> SourceLoad:
    # An LLM's requests reach its engine from the OpenAI routes too, not only through the version.
    model = version.async_model
    if isinstance(model, LLMModel) and model.served is not None:
        return model.served.current_load()
    return version_load(version)


def hint_config(config: ServerConfig) -> HintConfig:
    return HintConfig(
        target_requests=config.autoscale_target_requests,
        smoothing_s=config.autoscale_smoothing_s,
        downscale_window_s=config.autoscale_downscale_window_s,
        backlog_drain_s=config.autoscale_backlog_drain_s,
    )


def _parse_override(value: Any, limits: Limits) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise InvalidRequestError("the 'config' load parameter must be a JSON string")
    doc = decode_json(value.encode("utf-8"), limits)
    if not isinstance(doc, dict):
        raise InvalidRequestError("the 'config' load parameter must be a JSON object")
    return doc
