"""ModelManager: loads, reloads and unloads the repository's models.

Invariants:
- control operations on one model are serialised by that model's lock;
- a (re)load builds every new version completely before swapping it in, so a
  failed reload leaves the old versions serving;
- an unloaded version stops taking requests at once and finishes the ones it
  has before its instances are unloaded.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import (
    ConfigError,
    InvalidRequestError,
    KilnError,
    ModelLoadError,
    ModelNotFoundError,
    ModelUnavailableError,
)
from kiln.serving.ensemble.dag import validate_ensemble
from kiln.serving.ensemble.runner import EnsembleRunner
from kiln.serving.metrics import ServingMetrics
from kiln.serving.repository.config import ModelConfig, check_model_name
from kiln.serving.repository.loader import ModelSource, list_models, read_model
from kiln.serving.repository.version import LoadedVersion, load_instances
from kiln.serving.types import InferRequest

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
    def __init__(self, repository: str | Path, metrics: ServingMetrics | None = None):
        self.repository = Path(repository)
        self.metrics = metrics or ServingMetrics()
        self._entries: dict[str, ModelEntry] = {}
        self._closing: set[asyncio.Task] = set()

    # ------------------------------------------------------------ queries

    def entry(self, name: str) -> ModelEntry:
        check_model_name(name)
        return self._entries.setdefault(name, ModelEntry(name))

    def resolve(self, name: str, version: str = "") -> LoadedVersion:
        """The version that serves `name` (highest loaded if `version` is '')."""
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' is not found")
        if version and not version.isdigit():
            raise InvalidRequestError(f"model version must be a positive integer, got '{version}'")
        if entry.state != READY or not entry.versions:
            detail = f" ({entry.reason})" if entry.reason else ""
            raise ModelUnavailableError(f"model '{name}' is not ready: {entry.state}{detail}")
        if not version:
            return entry.versions[max(entry.versions)]
        loaded = entry.versions.get(int(version))
        if loaded is None:
            raise ModelNotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        return loaded

    def config_of(self, name: str, version: int | None = None) -> ModelConfig | None:
        entry = self._entries.get(name)
        if entry is None or entry.state != READY or not entry.versions:
            return None
        loaded = entry.versions.get(version) if version else entry.versions[max(entry.versions)]
        return loaded.config if loaded else None

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        names = set(self._entries)
        with contextlib.suppress(ConfigError):
            names.update(list_models(self.repository))
        rows = []
        for name in sorted(names):
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
        names = list_models(self.repository)
        ensembles = []
        for name in names:
            try:
                source = read_model(self.repository, name)
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
        if name not in self._entries and not (self.repository / name).is_dir():
            raise ModelNotFoundError(f"model '{name}' is not in the model repository")
        entry = self.entry(name)
        async with entry.lock:
            was_ready = entry.state == READY
            if not was_ready:
                entry.state, entry.reason = LOADING, ""
            try:
                source = read_model(self.repository, name, override)
                new = await self._build(source, _chain + (name,))
            except KilnError as exc:
                message = f"failed to load '{name}': {exc.message}"
                if not was_ready:
                    entry.state, entry.reason = UNAVAILABLE, message
                raise ModelLoadError(message) from None
            old, entry.versions = entry.versions, new
            entry.state, entry.reason = READY, ""
        await self._close_versions(list(old.values()))

    async def _build(self, source: ModelSource, chain: tuple[str, ...]) -> dict[int, LoadedVersion]:
        built: dict[int, LoadedVersion] = {}
        try:
            for version, directory in source.versions.items():
                built[version] = await self._build_version(source.config, version, directory, chain)
        except BaseException:
            await self._close_versions(list(built.values()))
            raise
        return built

    async def _build_version(self, config: ModelConfig, version: int, directory: Path, chain) -> LoadedVersion:
        start = time.perf_counter()
        if config.backend == "ensemble":
            runner = await self._build_ensemble(config, chain)
            return LoadedVersion(config, version, self.metrics, runner=runner)
        instances, resolved = await asyncio.to_thread(load_instances, config, version, directory)
        return LoadedVersion(resolved, version, self.metrics, instances=instances,
                             load_seconds=time.perf_counter() - start)

    async def _build_ensemble(self, config: ModelConfig, chain: tuple[str, ...]) -> EnsembleRunner:
        for step in config.steps:
            if self.config_of(step.model, step.version) is None:
                await self.load(step.model, _chain=chain)
        depends = validate_ensemble(config, lambda name: self._step_config(config, name))
        return EnsembleRunner(config, depends, self._member_infer)

    def _step_config(self, config: ModelConfig, name: str) -> ModelConfig | None:
        version = next((s.version for s in config.steps if s.model == name), None)
        return self.config_of(name, version)

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
