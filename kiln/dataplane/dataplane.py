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

Routes (`router.py`) are public names over model versions: `llm`,
`choose_llm`, `infer` and `stream_infer` resolve a route first, so every
transport routes the same way. A housekeeping task ticks the canaries and
samples the usage and CPU windows behind the cost and utilisation gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kiln.config import EngineConfig, ServerConfig, flat_options
from kiln.config_text import duplicate_json_key
from kiln.dataplane.autoscale import AutoscaleMonitor
from kiln.dataplane.llm_model import LLMModel
from kiln.dataplane.load import SourceLoad, version_load
from kiln.dataplane.restarts import RestartPolicy
from kiln.dataplane.routed import TARGET_PARAMETER, ChosenLLM
from kiln.dataplane.router import Router
from kiln.dataplane.routing.call import RouteCall
from kiln.dataplane.routing.spec import ROUTES_FILE, read_routes_file
from kiln.dataplane.routing.target import Target
from kiln.dataplane.served_llm import ServedLLM
from kiln.dataplane.usage import batched_reading, llm_reading
from kiln.errors import (
    ConfigError,
    DrainingError,
    ForbiddenError,
    InvalidRequestError,
    KilnError,
    ModelNotFoundError,
    ModelUnavailableError,
)
from kiln.llm.engine.core_client import discard_prespawned
from kiln.metrics.cost import CostCollector, UsageReading
from kiln.metrics.desired_replicas import HintConfig
from kiln.metrics.device import DeviceCollector
from kiln.metrics.engine_memory import EngineMemoryCollector
from kiln.metrics.process import ProcessCollector
from kiln.metrics.server_metrics import LLMMetricFamilies
from kiln.serving.codecs.kserve_http import decode_json
from kiln.serving.codecs.limits import Limits
from kiln.serving.metrics import ServingMetrics
from kiln.serving.parameters import flag_parameter
from kiln.serving.repository.config import RepositoryModelConfig
from kiln.serving.repository.manager import READY, UNAVAILABLE, ModelManager
from kiln.serving.repository.version import LoadedVersion
from kiln.serving.stats import ModelStats
from kiln.serving.types import InferRequest, InferResponse

log = logging.getLogger(__name__)

HOUSEKEEPING_S = 1.0  # canary ticks, autoscaling samples
SAMPLES_PER_WINDOW = 60  # usage/CPU snapshots per cost window


class DataPlane:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.limits = Limits(max_body_bytes=config.max_tensor_request_bytes)
        self.registry = CollectorRegistry()  # per server: several servers in one process never clash
        self.llm_metrics = LLMMetricFamilies(self.registry)
        self.models = ModelManager(
            config.model_repository, ServingMetrics(self.registry), backends={"llm": self._new_llm_model}
        )
        self.processes = ProcessCollector(self._pids, config.cost_window_s)
        self.registry.register(self.processes)
        self.device_metrics = DeviceCollector(model_name="")
        if self.device_metrics.available:
            self.registry.register(self.device_metrics)
        self.router = Router(self.registry, self._catalog, self._target_problem)
        self.costs = CostCollector(self._usage, self._server_price(), config.cost_window_s, self._route_targets)
        self.registry.register(self.costs)
        self.registry.register(EngineMemoryCollector(self._engine_memory))
        self.autoscale = AutoscaleMonitor(self.loads, hint_config(config))
        self.registry.register(self.autoscale)
        self.command_line_models: list[str] = []  # their load failure stops the server
        self.draining = False
        self.started = False
        self._housekeeping: asyncio.Task | None = None

    def _new_llm_model(self) -> LLMModel:
        return LLMModel(
            self.llm_metrics,
            engine_mode=self.config.engine_mode,
            max_queued_requests=self.config.max_queued_requests,
            drain_timeout_s=self.config.shutdown_timeout,
            restart_policy=RestartPolicy.of(self.config),
            max_rows=self.config.max_prompts_per_request,
            max_tokens_limit=self.config.max_tokens_limit,
        )

    def add_llm(self, config: EngineConfig, name: str) -> None:
        """Serve an LLM given on the command line (loaded by `start`)."""
        self.models.add_model({"backend": "llm", "parameters": flat_options(config)}, name)
        self.command_line_models.append(name)
        self.device_metrics.model_name = self.device_metrics.model_name or name

    def load_routes(self) -> None:
        """The routes file (`routes_file`, else routes.yaml in the repository, if there is one).

        Checked against the models to serve; ConfigError names every problem."""
        path = self.config.routes_file
        if path is None and self.config.model_repository is not None:
            default = Path(self.config.model_repository) / ROUTES_FILE
            path = str(default) if default.is_file() else None
        if path is not None:
            self.router.load(read_routes_file(Path(path)))

    def _server_price(self) -> float | None:
        price = self.config.price_per_hour
        if price is None or self.config.price_scope == "server":
            return price
        devices = 0
        if self.device_metrics.read is not None:
            try:
                devices = len(self.device_metrics.read())
            except Exception as exc:  # noqa: BLE001 - a failing GPU query must not stop the server
                log.warning("cannot count GPUs for --price-scope device (%s); pricing one device", exc)
        return price * max(1, devices)  # no GPU: the machine is the one device

    # ---- life cycle ----------------------------------------------------------
    async def start(self) -> dict[str, str]:
        """Load every model; returns {model: error} for those that failed."""
        if self._housekeeping is None:
            self._housekeeping = asyncio.create_task(self._housekeep())
        errors = await self.models.load_all()  # which logs each failure
        discard_prespawned()  # a command-line engine started ahead whose config no model took
        self.started = True
        return errors

    async def shutdown(self) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeping
        await self.router.close()
        await self.models.close()

    async def _housekeep(self) -> None:
        sample_every = max(HOUSEKEEPING_S, self.config.cost_window_s / SAMPLES_PER_WINDOW)
        last_sample = -float("inf")
        while True:
            try:
                self.router.tick()
                self.autoscale.sample()
                if time.monotonic() - last_sample >= sample_every:
                    last_sample = time.monotonic()
                    self.costs.sample()
                    self.processes.sample()
            except Exception:  # noqa: BLE001 - housekeeping must go on
                log.exception("housekeeping failed")
            await asyncio.sleep(HOUSEKEEPING_S)

    # ---- health --------------------------------------------------------------
    def live(self) -> bool:
        """False once an engine is dead with no restart left: it never comes back in this
        process, so the process must be restarted (an engine being restarted is still live)."""
        return "dead" not in self.model_states().values()

    def model_states(self) -> dict[str, str]:
        """Every model's state: ready, loading, unavailable, unloading, and for an LLM whose
        engine died: restarting (a new one is starting) or dead (no restart left)."""
        states = {}
        for row in self.models.index():
            if row.get("reason") == "unloaded":
                continue
            name = row["name"]
            state = row["state"].lower() if "state" in row else ("unavailable" if self.started else "loading")
            if state == "ready":
                loaded = self.models.resolve(name)
                if not loaded.healthy():
                    model = loaded.async_model
                    state = model.served.state if isinstance(model, LLMModel) and model.served else "dead"
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
        """The LLM a request names (a model, a route, or None: the first model), or the error saying why not."""
        self._refuse_if_draining()
        route = self.router.table.get(name)
        if route is not None:
            return self._target_llm(route.choose(None))
        return self._named_llm(name)

    def choose_llm(self, name: str | None, route_key: str | None = None) -> ChosenLLM:
        """The LLM an OpenAI request goes to; through a route, the call that records its outcome.

        `route_key` keeps a client on one target while the weights stand."""
        self._refuse_if_draining()
        call = self.router.call(name, route_key)
        if call is None:
            return ChosenLLM(self._named_llm(name))
        try:
            served = self._target_llm(call.target)
        except KilnError as exc:
            call.finish(exc)
            raise
        return ChosenLLM(served, call, self._shadow_llm)

    def llm_route_names(self) -> list[str]:
        """Routes with at least one LLM target (the OpenAI routes list them as models)."""
        return [name for name in self.router.table.names()
                if any(self._is_llm(t.model) for t in self.router.table.routes[name].targets.values())]

    def _target_llm(self, target: Target) -> ServedLLM:
        with _target_gone_unavailable(target):
            model = self.models.resolve(target.model, target.version_str).async_model
        if not isinstance(model, LLMModel) or model.served is None:
            raise InvalidRequestError(f"route target '{target}' is not an LLM", param="model")
        return model.served

    def _shadow_llm(self, call: RouteCall, run: Callable[[ServedLLM], Awaitable[Any]]) -> None:
        async def shadow(target: Target) -> None:
            await run(self._target_llm(target))

        self.router.shadow(call, shadow)

    def _named_llm(self, name: str | None) -> ServedLLM:
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
    def model_ready(self, name: str, version: str = "", unknown_raises: bool = False) -> bool:
        """Whether the model (or route) serves now. `unknown_raises`: a name this server has
        never heard of raises ModelNotFoundError (HTTP's 404) instead of answering False
        (gRPC's ModelReady answers ready: false, as Triton's does)."""
        route = self.router.table.get(name)
        if route is not None:  # ready while a target it sends traffic to is
            _no_version(name, version)
            return any(w > 0 and self.model_ready(route.targets[t].model, route.targets[t].version_str)
                       for t, w in route.weights().items())
        try:
            loaded = self.models.resolve(name, version)
        except InvalidRequestError:
            raise
        except ModelNotFoundError:
            if unknown_raises and name not in self.models.names():  # a mistyped probe: not "not ready yet"
                raise
            return False
        except Exception:  # noqa: BLE001 - unavailable = not ready
            return False
        return loaded.healthy()

    def model_config(self, name: str, version: str = "") -> RepositoryModelConfig:
        route = self.router.table.get(name)
        if route is None:
            return self.models.resolve(name, version).config
        _no_version(name, version)
        weights = route.weights()
        # The heaviest target that serves now: the route is ready while any target with traffic is.
        ready = [t for t, w in weights.items() if w > 0 and self._target_problem(route.targets[t]) is None]
        heaviest = route.targets[max(ready or weights, key=lambda t: (weights[t], t))]
        with _target_gone_unavailable(heaviest):
            config = self.models.resolve(heaviest.model, heaviest.version_str).config
        return config.model_copy(update={"name": name})  # a route's inputs/outputs are its targets'

    def model_versions(self, name: str) -> list[int]:
        if self.router.is_route(name):
            return []
        return sorted(self.models.entry(name).versions)

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        route = self.router.table.get(name)
        if route is not None:  # the statistics of the versions its targets name, each under its own name
            _no_version(name, version)
            served = {}
            for target in route.targets.values():
                with contextlib.suppress(KilnError):  # a target not served now has none
                    serving = self.models.resolve(target.model, target.version_str)
                    served[(target.model, serving.version)] = serving.stats
            return [served[key] for key in sorted(served)]
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

    async def infer(self, request: InferRequest, route_key: str | None = None) -> InferResponse:
        """Run one request. Through a route, the response names the route and, in its
        `kiln_route_target` parameter, the target that served it."""
        self._refuse_if_draining()
        call = self.router.call(request.model_name, route_key)
        if call is None:
            loaded, outputs = await self.models.infer(request)
            return InferResponse(request.model_name, str(loaded.version), outputs, id=request.id)
        try:
            routed = self._retarget(request, call)
            with _target_gone_unavailable(call.target):
                loaded, outputs = await self.models.infer(routed)
        except BaseException as exc:
            call.finish(exc)
            raise
        call.finish()
        return InferResponse(request.model_name, str(loaded.version), outputs, id=request.id,
                             parameters={TARGET_PARAMETER: str(call.target)})

    async def stream_infer(
        self, request: InferRequest, route_key: str | None = None
    ) -> AsyncGenerator[InferResponse, None]:
        """The responses of one request: several when the model streams it, else one."""
        self._refuse_if_draining()
        call = self.router.call(request.model_name, route_key)
        if call is None:
            loaded = self.models.resolve(request.model_name, request.model_version)
            async for response in loaded.stream(request):
                response.model_version = str(loaded.version)
                yield response
            return
        try:
            routed = self._retarget(request, call)
            with _target_gone_unavailable(call.target):
                loaded = self.models.resolve(routed.model_name, routed.model_version)
            async for response in loaded.stream(routed):
                response.model_name, response.model_version = request.model_name, str(loaded.version)
                response.parameters = {**response.parameters, TARGET_PARAMETER: str(call.target)}
                yield response
        except BaseException as exc:
            call.finish(exc)
            raise
        call.finish()

    def _retarget(self, request: InferRequest, call: RouteCall) -> InferRequest:
        """The request as its target gets it; copies go to the route's shadows."""
        _no_version(request.model_name, request.model_version)
        if call.route.shadows:
            # Taken now, before the target runs: a model that writes into its inputs cannot touch the copies.
            snapshot = dataclasses.replace(request, inputs={k: a.copy() for k, a in request.inputs.items()},
                                           parameters=dict(request.parameters))
            self.router.shadow(call, lambda target: self._shadow_infer(snapshot, target))
        return dataclasses.replace(request, model_name=call.target.model, model_version=call.target.version_str)

    async def _shadow_infer(self, snapshot: InferRequest, target: Target) -> None:
        copy = dataclasses.replace(snapshot, model_name=target.model, model_version=target.version_str,
                                   inputs={k: a.copy() for k, a in snapshot.inputs.items()})
        loaded = self.models.resolve(copy.model_name, copy.model_version)
        async for _ in loaded.stream(copy):
            pass

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise DrainingError("the server is shutting down and accepts no new requests")

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository extension's index. A loaded version whose engine died (or is being
        replaced) is UNAVAILABLE with the reason: the index said READY while it answered 503s."""
        rows = []
        for row in self.models.index():
            if row.get("state") == READY and "version" in row:
                loaded = self.models.entry(row["name"]).versions[int(row["version"])]
                model = loaded.async_model
                if model is not None and not loaded.healthy():
                    row = {**row, "state": UNAVAILABLE, "reason": model.health_problem()}
            if not ready_only or row.get("state") == READY:
                rows.append(row)
        return rows

    def _check_model_control(self) -> None:
        if self.config.model_control != "explicit":
            raise ForbiddenError(
                "model load/unload is not allowed: the server runs with --model-control none "
                "(start it with --model-control explicit to allow it)"
            )

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        """Load or reload a repository model (the KServe repository extension; --model-control explicit)."""
        self._check_model_control()
        if self.router.is_route(name):
            raise ConfigError(f"'{name}' is a route; a model cannot take its name", param="name")
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
        self._check_model_control()
        parameters = parameters or {}
        unknown = set(parameters) - {"unload_dependents"}
        if unknown:
            raise InvalidRequestError(f"unknown unload parameter(s) {sorted(unknown)}")
        await self.models.unload(name, flag_parameter(parameters, "unload_dependents"))

    # ---- routes: what they need of the models ---------------------------------
    def _catalog(self) -> dict[str, list[int] | None]:
        return {name: self.models.served_versions(name) for name in self.models.names()}

    def _target_problem(self, target: Target) -> str | None:
        try:
            loaded = self.models.resolve(target.model, target.version_str)
        except KilnError as exc:
            return exc.message
        return None if loaded.healthy() else "its engine is not running"

    # ---- metrics -------------------------------------------------------------
    def _loaded_versions(self) -> list[tuple[str, LoadedVersion]]:
        out = []
        for row in self.models.index(ready_only=True):
            loaded = self.models.entry(row["name"]).versions.get(int(row["version"]))
            if loaded is not None:
                out.append((row["name"], loaded))
        return out

    def _usage(self) -> dict[tuple[str, str], UsageReading]:
        """Cumulative use of every loaded model version (ensembles have none of their own)."""
        usage = {}
        for name, loaded in self._loaded_versions():
            key = (name, str(loaded.version))
            model = loaded.async_model
            if isinstance(model, LLMModel) and model.served is not None:
                usage[key] = llm_reading(model.served.usage)
            elif loaded.batcher is not None:
                usage[key] = batched_reading(loaded.stats)
        return usage

    def _route_targets(self) -> list[tuple[str, str, tuple[str, str]]]:
        """(route, target, the model version serving it now) for the per-target cost gauges."""
        out = []
        for name in self.router.table.names():
            for text, target in self.router.table.routes[name].targets.items():
                versions = self.models.served_versions(target.model) or []
                version = target.version if target.version is not None else max(versions, default=None)
                if version is not None:
                    out.append((name, text, (target.model, str(version))))
        return out

    def _engine_memory(self) -> dict[tuple[str, str], dict[str, int]]:
        memory = {}
        for name, loaded in self._loaded_versions():
            model = loaded.async_model
            served = model.served if isinstance(model, LLMModel) else None
            info = served.engine.info if served is not None and served.engine is not None else None
            if info is not None:
                memory[(name, str(loaded.version))] = {
                    "weights": info.weights_bytes, "packed": info.packed_bytes, "kv_cache": info.kv_cache_bytes,
                    "activations_peak": info.activations_peak_bytes,
                }
        return memory

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


@contextlib.contextmanager
def _target_gone_unavailable(target: Target) -> Iterator[None]:
    """A route target whose model or version is no longer served (unloaded, or dropped by a
    reload's version policy) is the server's failure, a 503 that a canary counts as an error,
    not the caller's 404: the caller named the route, which exists."""
    try:
        yield
    except ModelNotFoundError as exc:
        raise ModelUnavailableError(f"route target '{target}' is not served now: {exc.message}") from None


def _no_version(name: str, version: str) -> None:
    if version:
        raise InvalidRequestError(
            f"'{name}' is a route: it picks the version itself (its targets name versions); drop version {version!r}"
        )


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
    try:
        doc = decode_json(value.encode("utf-8"), limits)
    except InvalidRequestError as exc:  # said "failed to parse the request JSON", as if the body were wrong
        raise InvalidRequestError(f"the 'config' load parameter is not valid JSON: "
                                  f"{exc.message.removeprefix('failed to parse the request JSON: ')}") from None
    if not isinstance(doc, dict):
        raise InvalidRequestError("the 'config' load parameter must be a JSON object")
    duplicate = duplicate_json_key(value)
    if duplicate is not None:  # as in a config.yaml: the last value would win in silence
        raise InvalidRequestError(f"the 'config' load parameter names the key {duplicate!r} twice in one object")
    return doc
