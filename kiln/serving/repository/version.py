"""One loaded model version: its instances, scheduler, stats and in-flight count.

Invariant: `inflight` counts requests between `infer` entry and exit; `close`
refuses new requests first, then waits for `inflight` to reach zero before
stopping the scheduler and unloading the instances.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import numpy as np

from kiln.errors import (
    ConfigError,
    InvalidRequestError,
    KilnError,
    ModelUnavailableError,
    OverloadedError,
    RequestTimeoutError,
)
from kiln.serving.backends.registry import create_model
from kiln.serving.batching.batcher import DynamicBatcher
from kiln.serving.ensemble.runner import EnsembleRunner
from kiln.serving.metrics import ServingMetrics
from kiln.serving.model import LoadContext, Model
from kiln.serving.repository.config import ModelConfig, Warmup
from kiln.serving.stats import ModelStats
from kiln.serving.types import InferRequest, as_bytes_array, numpy_dtype
from kiln.serving.validation import validate_request


def load_instances(config: ModelConfig, version: int, version_dir: Path) -> tuple[list[Model], ModelConfig]:
    """Create and load `instance_count` backend objects (blocking; run in a
    thread). Returns them with the config completed from the artifact."""
    instances: list[Model] = []
    try:
        for index in range(config.instance_count):
            model = create_model(config.backend)
            model.load(LoadContext(config, version, version_dir, index))
            instances.append(model)
        resolved = _resolve_io(config, instances[0])
        for model in instances:
            if hasattr(model, "config"):
                model.config = resolved
        for warmup in resolved.warmup:
            _warm(resolved, instances, warmup)
        return instances, resolved
    except BaseException:
        for model in instances:
            _quiet_unload(model)
        raise


def _resolve_io(config: ModelConfig, model: Model) -> ModelConfig:
    if config.has_io:
        return config
    specs = model.io_specs()
    if specs is None:
        raise ConfigError(f"model '{config.name}' must list its inputs and outputs in config.yaml")
    inputs, outputs = specs
    return config.model_copy(update={"inputs": config.inputs or inputs, "outputs": config.outputs or outputs})


def _warm(config: ModelConfig, instances: list[Model], warmup: Warmup) -> None:
    rng = np.random.default_rng(0)
    inputs = {}
    for name, spec in warmup.inputs.items():
        shape = ((warmup.batch_size,) if config.max_batch_size else ()) + spec.dims
        dtype = numpy_dtype(spec.datatype)
        if spec.datatype == "BYTES":
            inputs[name] = np.full(shape, b"", dtype=object)
        elif spec.data == "random":
            inputs[name] = rng.random(shape).astype(dtype)
        else:
            inputs[name] = np.zeros(shape, dtype=dtype)
    request = InferRequest(model_name=config.name, inputs=inputs)
    validate_request(request, config)
    for model in instances:
        for _ in range(warmup.count):
            result = model.execute([request])[0]
            if isinstance(result, BaseException):
                raise ConfigError(f"warm-up '{warmup.name}' of model '{config.name}' failed: {result}")


def _quiet_unload(model: Model) -> None:
    with contextlib.suppress(Exception):  # best effort while failing a load
        model.unload()


class LoadedVersion:
    def __init__(self, config: ModelConfig, version: int, metrics: ServingMetrics,
                 instances: list[Model] | None = None, runner: EnsembleRunner | None = None,
                 load_seconds: float = 0.0):
        self.config = config
        self.version = version
        self.metrics = metrics
        self.instances = instances or []
        self.runner = runner
        self.load_seconds = load_seconds
        self.stats = ModelStats(config.name, str(version))
        self.batcher = None if runner else DynamicBatcher(config, str(version), self.instances, self.stats, metrics)
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False
        metrics.load_seconds.labels(config.name, str(version)).set(load_seconds)

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        if self.closing:
            raise ModelUnavailableError(f"model '{self.config.name}' version {self.version} is unloading")
        start = time.perf_counter_ns()
        labels = (self.config.name, str(self.version))
        self.inflight += 1
        self._idle.clear()
        self.metrics.pending.labels(*labels).inc()
        try:
            validate_request(request, self.config)
            outputs = await self._dispatch(request)
            outputs = self._conform(outputs, request)
        except BaseException as exc:
            self._count(start, False, _reason(exc))
            raise
        finally:
            self.inflight -= 1
            self.metrics.pending.labels(*labels).dec()
            if self.inflight == 0:
                self._idle.set()
        self._count(start, True, "")
        return outputs

    async def _dispatch(self, request: InferRequest) -> dict[str, np.ndarray]:
        if self.runner is not None:
            outputs = await self.runner.run(request)
            self.stats.record_execution(request.batch_size() or 1, 1, 0, 0, 0)
            return outputs
        return await self.batcher.submit(request)

    def _count(self, start: int, ok: bool, reason: str) -> None:
        elapsed = time.perf_counter_ns() - start
        (self.stats.success if ok else self.stats.fail).add(elapsed)
        self.metrics.request_done(self.config.name, str(self.version), ok, elapsed, reason)

    def _conform(self, outputs: dict[str, np.ndarray], request: InferRequest) -> dict[str, np.ndarray]:
        """Requested outputs only, each in its declared datatype."""
        specs = request.outputs if request.outputs is not None else self.config.outputs
        names = [s.name for s in specs]
        result = {}
        for name in names:
            if name not in outputs:
                raise KilnError(f"model '{self.config.name}' did not produce output '{name}'")
            spec = self.config.output(name)
            array = np.asarray(outputs[name])
            if spec.datatype == "BYTES":
                array = as_bytes_array(array)
            elif array.dtype != numpy_dtype(spec.datatype):
                array = array.astype(numpy_dtype(spec.datatype))
            result[name] = array
        return result

    def queue_size(self) -> int:
        return self.batcher.queue_size() if self.batcher else 0

    async def close(self) -> None:
        self.closing = True
        await self._idle.wait()
        if self.batcher is not None:
            await self.batcher.stop()
        await asyncio.to_thread(lambda: [_quiet_unload(m) for m in self.instances])


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (OverloadedError, RequestTimeoutError)):
        return "REJECTED"
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELED"
    if isinstance(exc, (InvalidRequestError, ModelUnavailableError)):
        return "OTHER"
    return "BACKEND"

