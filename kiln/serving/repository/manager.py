"""ModelManager: loads, reloads and unloads the served models.

Models come from the repository directory or are added in memory
(`add_model`: a model given on the command line, with a config and one
version but no files). Backends are created by name through the registry,
or by the factories passed in (the data plane passes the `llm` backend, so
this package never imports the LLM engine).

Invariants:
- control operations on one model are serialised by that model's lock;
- a (re)load builds every new version completely before swapping it in, so a
  failed reload leaves the old versions serving;
- an unloaded version stops taking requests at once and finishes the ones it
  has before its instances are unloaded;
- one model's load failure, of any kind, marks that model unavailable and
  never stops the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import (
    ConfigError,
    InvalidRequestError,
    KilnError,
    ModelConfigLoadError,
    ModelLoadError,
    ModelLoadingError,
    ModelNotFoundError,
    ModelUnavailableError,
    describe,
)
from kiln.serving.backends.registry import create_model
from kiln.serving.ensemble.dag import validate_ensemble
from kiln.serving.ensemble.runner import EnsembleRunner
from kiln.serving.metrics import ServingMetrics
from kiln.serving.model import AsyncModel, Model
from kiln.serving.repository.config import RepositoryModelConfig, check_model_name, parse_config
from kiln.serving.repository.loader import ModelSource, list_models, read_model
from kiln.serving.repository.triton_format import from_triton, is_triton_form
from kiln.serving.repository.version import LoadedVersion, load_async_model, load_instances
from kiln.serving.types import InferRequest

BackendFactory = Callable[[], Model | AsyncModel]

log = logging.getLogger("kiln.serving")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


@dataclass
class ModelEntry:
    name: str
    versions: dict[int, LoadedVersion] = field(default_factory=dict)
    state: str = UNAVAILABLE
    reason: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ModelManager:
    def __init__(
        self,
        repository: str | Path | None,
        metrics: ServingMetrics | None = None,
        backends: Mapping[str, BackendFactory] | None = None,
    ):
        self.repository = Path(repository) if repository is not None else None
        self.metrics = metrics or ServingMetrics()
        self.backends = dict(backends or {})
        self._entries: dict[str, ModelEntry] = {}
        self._in_memory: dict[str, RepositoryModelConfig] = {}

    def add_model(self, config: dict[str, Any], name: str) -> None:
        """Serve a model that has no directory: version 1, this config (not loaded yet)."""
        parsed = parse_config(config, name=name)
        if name in self._in_memory or name in self._disk_names():
            raise ConfigError(f"model name {name!r} is served twice", param="name")
        self._in_memory[name] = parsed
        self.entry(name).state = LOADING  # `load_all` loads it

    def _disk_names(self) -> list[str]:
        return list_models(self.repository) if self.repository is not None else []

    def _read(self, name: str, override: dict[str, Any] | None = None) -> ModelSource:
        config = self._in_memory.get(name)
        if config is None:
            if self.repository is None:
                raise ModelNotFoundError(f"model '{name}' is not served and there is no model repository")
            return read_model(self.repository, name, override)
        if override is not None:
            config = parse_config(from_triton(override, config) if is_triton_form(override) else override, name=name)
        return ModelSource(name, config, None, {1: None})

    # ------------------------------------------------------------ queries

    def entry(self, name: str) -> ModelEntry:
        check_model_name(name)
        return self._entries.setdefault(name, ModelEntry(name))

    def resolve(self, name: str, version: str = "") -> LoadedVersion:
        """The version that serves `name` (highest loaded if `version` is '')."""
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' is not found")
        if version and not (version.isascii() and version.isdigit()):  # not '²' or '٣'; int() refuses the first
            raise InvalidRequestError(f"model version must be a positive integer, got '{version}'")
        if entry.state == LOADING and not entry.versions:
            raise ModelLoadingError(f"model '{name}' is still loading")
        if entry.state != READY or not entry.versions:
            detail = f" ({entry.reason})" if entry.reason else ""
            raise ModelUnavailableError(f"model '{name}' is not ready: {entry.state}{detail}")
        if not version:
            return entry.versions[max(entry.versions)]
        loaded = entry.versions.get(int(version))
        if loaded is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        return loaded

    def config_of(self, name: str, version: int | None = None) -> RepositoryModelConfig | None:
        entry = self._entries.get(name)
        if entry is None or entry.state != READY or not entry.versions:
            return None
        loaded = entry.versions.get(version) if version else entry.versions[max(entry.versions)]
        return loaded.config if loaded else None

    def names(self) -> list[str]:
        """Every model known: in memory, on disk, or loaded before."""
        names = set(self._entries) | set(self._in_memory)
        with contextlib.suppress(ConfigError):
            names.update(self._disk_names())
        return sorted(names)

    def source_config(self, name: str) -> RepositoryModelConfig | None:
        """The config a model is (or would be) loaded with, without loading it."""
        loaded = self.config_of(name)
        if loaded is not None:
            return loaded
        try:
            return self._read(name).config
        except KilnError:
            return None

    def served_versions(self, name: str) -> list[int] | None:
        """The versions of `name` loaded now, else those its config would load; None if unknown or unreadable."""
        entry = self._entries.get(name)
        if entry is not None and entry.versions:
            return sorted(entry.versions)
        try:
            return sorted(self._read(name).versions)
        except KilnError:
            return None

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        rows = []
        for name in self.names():
            entry = self._entries.get(name)
            if entry and entry.versions:
                for version in sorted(entry.versions):
                    rows.append({"name": name, "version": str(version), "state": entry.state, "reason": entry.reason})
            elif not ready_only:
                row = {"name": name}
                if entry:
                    row.update(state=entry.state, reason=entry.reason)
                rows.append(row)
        return [r for r in rows if not ready_only or r.get("state") == READY]

    def loaded_versions(self) -> dict[str, list[LoadedVersion]]:
        """Every model with loaded versions, lowest version first (reads no files)."""
        return {name: [e.versions[v] for v in sorted(e.versions)] for name, e in self._entries.items() if e.versions}

    def all_ready(self) -> bool:
        return all(e.state == READY for e in self._entries.values() if e.reason != "unloaded")

    # ------------------------------------------------------------ inference

    async def infer(self, request: InferRequest) -> tuple[LoadedVersion, dict[str, np.ndarray]]:
        version = self.resolve(request.model_name, request.model_version)
        return version, await version.infer(request)

    async def _member_infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        return (await self.infer(request))[1]

    # ------------------------------------------------------------ control

    async def load_all(self) -> dict[str, str]:
        """Load every model in the repository; return {name: error} for failures.
        One model failing never stops the others."""
        errors: dict[str, str] = {}
        names = sorted(set(self._in_memory) | set(self._disk_names()))
        ensembles = []
        for name in names:
            try:
                source = self._read(name)
            except KilnError as exc:
                errors[name] = self._fail_entry(name, exc)
                continue
            if source.config.backend == "ensemble":
                ensembles.append(name)
            else:
                await self._load_recorded(name, errors)
        for name in ensembles:
            await self._load_recorded(name, errors)
        return errors

    async def _load_recorded(self, name: str, errors: dict[str, str]) -> None:
        try:
            await self.load(name)
        except KilnError as exc:
            errors[name] = exc.message
            log.error("model %s failed to load: %s", name, exc.message)

    def _fail_entry(self, name: str, exc: KilnError) -> str:
        try:
            entry = self.entry(name)
        except ConfigError:
            return exc.message
        entry.state, entry.reason = UNAVAILABLE, exc.message
        return exc.message

    async def load(self, name: str, override: dict[str, Any] | None = None, _chain: tuple[str, ...] = ()) -> None:
        """Load or reload `name`. On failure the previous versions keep serving."""
        if name in _chain:
            raise ModelLoadError(f"ensembles {list(_chain)} include each other")
        check_model_name(name)
        # Looked up on disk even for a model loaded before: its directory may have gone since.
        on_disk = self.repository is not None and (self.repository / name).is_dir()
        if name not in self._in_memory and not on_disk:
            raise ModelNotFoundError(f"model '{name}' is not in the model repository")
        entry = self.entry(name)
        async with entry.lock:
            was_ready = entry.state == READY
            if not was_ready:
                entry.state, entry.reason = LOADING, ""
            try:
                source = self._read(name, override)
                new = await self._build(source, _chain + (name,))
            except (KeyboardInterrupt, asyncio.CancelledError, GeneratorExit):
                if not was_ready:  # never left LOADING, which would hold the server not ready
                    entry.state, entry.reason = UNAVAILABLE, f"loading '{name}' was interrupted"
                raise
            except BaseException as exc:  # noqa: BLE001 - any backend's failure (a model's SystemExit too) stays its own
                detail = exc.message if isinstance(exc, KilnError) else describe(exc)
                message = f"failed to load '{name}': {self._redact(detail)}"
                if not isinstance(exc, KilnError):
                    log.exception("loading model %s raised", name)
                if not was_ready:
                    entry.state, entry.reason = UNAVAILABLE, message
                # The model's files or settings are unusable (a config, a missing or corrupt file): the
                # request's to fix, 400 as Triton's; anything else failed in the server, 500.
                unusable = isinstance(exc, ConfigError | ModelLoadError)
                raise (ModelConfigLoadError if unusable else ModelLoadError)(message) from None
            old, entry.versions = entry.versions, new
            entry.state, entry.reason = READY, ""
        await self._close_versions(list(old.values()))

    def _redact(self, text: str) -> str:
        """A load error as clients may read it: the repository's host path left out."""
        if self.repository is None:
            return text
        for root in sorted({str(self.repository.resolve()), str(self.repository)}, key=len, reverse=True):
            # Whole paths only: the root "repo" is not the start of "repository", nor "." of "model.py".
            text = re.sub(rf"(?<![\w.\-/]){re.escape(root)}(?![\w.\-])", "<repository>", text)
        return text

    async def _build(self, source: ModelSource, chain: tuple[str, ...]) -> dict[int, LoadedVersion]:
        built: dict[int, LoadedVersion] = {}
        try:
            for version, directory in source.versions.items():
                built[version] = await self._build_version(source.config, version, directory, chain)
        except BaseException:
            await self._close_versions(list(built.values()))
            raise
        return built

    async def _build_version(
        self, config: RepositoryModelConfig, version: int, directory: Path | None, chain
    ) -> LoadedVersion:
        start = time.perf_counter()
        if config.backend == "ensemble":
            runner = await self._build_ensemble(config, chain)
            return LoadedVersion(config, version, self.metrics, runner=runner)
        factory = self.backends.get(config.backend) or (lambda: create_model(config.backend))
        probe = factory()
        if isinstance(probe, AsyncModel):
            resolved = await load_async_model(probe, config, version, directory)
            return LoadedVersion(resolved, version, self.metrics, async_model=probe,
                                 load_seconds=time.perf_counter() - start)
        made = iter([probe])  # the first instance is the one already created

        def create() -> Model:
            model = next(made, None) or factory()
            assert isinstance(model, Model)  # a factory makes one kind of model
            return model

        instances, resolved = await asyncio.to_thread(load_instances, config, version, directory, create)
        return LoadedVersion(resolved, version, self.metrics, instances=instances,
                             load_seconds=time.perf_counter() - start)

    async def _build_ensemble(self, config: RepositoryModelConfig, chain: tuple[str, ...]) -> EnsembleRunner:
        for step in config.steps:
            if self.config_of(step.model, step.version) is None:
                await self.load(step.model, _chain=chain)
        depends = validate_ensemble(config, self.config_of)
        return EnsembleRunner(config, depends, self._member_infer)

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Stop serving `name`; returns once its in-flight requests are done."""
        entry = self._entries.get(name)
        if entry is None:
            check_model_name(name)
            raise ModelNotFoundError(f"Request for unknown model: '{name}' is not found")
        async with entry.lock:
            old, entry.versions = entry.versions, {}
            entry.state, entry.reason = UNLOADING, ""
            await self._close_versions(list(old.values()))
            entry.state, entry.reason = UNAVAILABLE, "unloaded"
        if unload_dependents:
            for dependent in self._dependents(name):
                await self.unload(dependent)

    def _dependents(self, name: str) -> list[str]:
        out = []
        for other in self._entries.values():
            for version in other.versions.values():
                if any(step.model == name for step in version.config.steps):
                    out.append(other.name)
                    break
        return out

    async def _close_versions(self, versions: list[LoadedVersion]) -> None:
        for version in versions:
            version.closing = True
        await asyncio.gather(*(v.close() for v in versions))

    async def close(self) -> None:
        """Unload everything (server shutdown); waits for in-flight requests."""
        for name in list(self._entries):
            if self._entries[name].versions:
                await self.unload(name)
