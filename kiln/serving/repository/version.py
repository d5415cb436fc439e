"""One loaded model version: its instances (or async model), batcher, stats
and in-flight count.

Invariant: `inflight` counts requests between `infer`/`stream` entry and
exit; `close` refuses new requests first, then waits for `inflight` to reach
zero before stopping the batcher and unloading the instances.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
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
from kiln.serving.batching.batcher import DynamicBatcher
from kiln.serving.ensemble.runner import EnsembleRunner
from kiln.serving.metrics import ServingMetrics
from kiln.serving.model import AsyncModel, LoadContext, Model
from kiln.serving.repository.config import RepositoryModelConfig, TensorSpec, Warmup, check_warmup
from kiln.serving.stats import ModelStats
from kiln.serving.types import InferRequest, InferResponse, as_bytes_array, numpy_dtype
from kiln.serving.validation import shape_fits, validate_request


def load_instances(
    config: RepositoryModelConfig, version: int, version_dir: Path | None, create: Callable[[], Model]
) -> tuple[list[Model], RepositoryModelConfig]:
    """Create and load `instance_count` backend objects (blocking; run in a
    thread). Returns them with the config completed from the artifact."""
    instances: list[Model] = []
    try:
        for index in range(config.instance_count):
            model = create()
            model.load(LoadContext(config, version, version_dir, index))
            instances.append(model)
        resolved = _resolve_io(config, instances[0])
        # Inputs read from the artifact were unknown when config.yaml was parsed.
        check_warmup(resolved)
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


async def load_async_model(
    model: AsyncModel, config: RepositoryModelConfig, version: int, version_dir: Path | None
) -> RepositoryModelConfig:
    """Load an async model on the event loop; returns the config completed from it."""
    await model.load(LoadContext(config, version, version_dir))
    try:
        return _resolve_io(config, model)
    except BaseException:
        await model.unload()
        raise


def _resolve_io(config: RepositoryModelConfig, model: Model | AsyncModel) -> RepositoryModelConfig:
    if config.has_io:
        return config
    specs = model.io_specs()
    if specs is None:
        raise ConfigError(f"model '{config.name}' must list its inputs and outputs in config.yaml")
    inputs, outputs = specs
    return config.model_copy(update={"inputs": config.inputs or inputs, "outputs": config.outputs or outputs})


def _warm(config: RepositoryModelConfig, instances: list[Model], warmup: Warmup) -> None:
    rng = np.random.default_rng(0)
    inputs = {}
    for name, spec in warmup.inputs.items():
        shape = ((warmup.batch_size,) if config.max_batch_size else ()) + spec.dims
        dtype = numpy_dtype(spec.datatype)
        if spec.datatype == "BYTES":
            inputs[name] = np.full(shape, b"", dtype=object)
        elif spec.data == "random" and dtype.kind in "iub":  # [0, 1) cast would be all zeros; 0/1 stays a valid index
            inputs[name] = rng.integers(0, 2, shape).astype(dtype)
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


def _unload_all(models: list[Model]) -> None:
    for model in models:
        _quiet_unload(model)


def _quiet_unload(model: Model) -> None:
    with contextlib.suppress(BaseException):  # best effort while failing a load (a backend's SystemExit too)
        model.unload()


class LoadedVersion:
    """Exactly one of `instances` (batched through a DynamicBatcher), `runner`
    (an ensemble) or `async_model` serves the version."""

    def __init__(self, config: RepositoryModelConfig, version: int, metrics: ServingMetrics,
                 instances: list[Model] | None = None, runner: EnsembleRunner | None = None,
                 async_model: AsyncModel | None = None, load_seconds: float = 0.0):
        self.config = config
        self.version = version
        self.metrics = metrics
        self.instances = instances or []
        self.runner = runner
        self.async_model = async_model
        self.load_seconds = load_seconds
        self.stats = ModelStats(config.name, str(version))
        self.batcher = None
        if instances:
            self.batcher = DynamicBatcher(config, str(version), self.instances, self.stats, metrics)
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False
        metrics.load_seconds.labels(config.name, str(version)).set(load_seconds)

    def healthy(self) -> bool:
        return self.async_model is None or self.async_model.healthy()

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        # `_tracked` spelled out: the async context manager costs ~3 us a request.
        start = self._begin(request)
        try:
            outputs = self._conform(await self._dispatch(request), request)
        except BaseException as exc:
            self._end(start, exc)
            raise
        self._end(start, None)
        return outputs

    async def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """The model's streamed responses for `request` (each conformed to the
        requested outputs), or its one response when it does not stream."""
        async with self._tracked(request):
            responses = self.async_model.stream(request) if self.async_model is not None else None
            if responses is None:
                outputs = self._conform(await self._dispatch(request), request)
                yield InferResponse(request.model_name, str(self.version), outputs, id=request.id)
                return
            start = time.perf_counter_ns()
            try:
                async with contextlib.aclosing(responses) as it:
                    async for response in it:
                        response.outputs = self._conform(response.outputs, request)
                        yield response
            finally:  # one execution, streamed or not, whether it finished, failed or was cancelled
                self._executed(request, time.perf_counter_ns() - start)

    @contextlib.asynccontextmanager
    async def _tracked(self, request: InferRequest) -> AsyncIterator[None]:
        """Refuse when closing; validate; count in flight, statistics and metrics."""
        start = self._begin(request)
        try:
            yield
        except BaseException as exc:
            self._end(start, exc)
            raise
        self._end(start, None)

    def _begin(self, request: InferRequest) -> int:
        """Admit `request` (refused when closing, validated) as in flight; its start time."""
        if self.closing:
            raise ModelUnavailableError(f"model '{self.config.name}' version {self.version} is unloading")
        start = time.perf_counter_ns()
        try:
            validate_request(request, self.config)
        except BaseException as exc:
            self._count(start, False, _reason(exc))
            raise
        self.inflight += 1
        self._idle.clear()
        self.metrics.child(self.metrics.pending, self.config.name, str(self.version)).inc()
        return start

    def _end(self, start: int, exc: BaseException | None) -> None:
        """Invariant: called once per successful `_begin`, whatever happened."""
        self.inflight -= 1
        self.metrics.child(self.metrics.pending, self.config.name, str(self.version)).dec()
        if self.inflight == 0:
            self._idle.set()
        self._count(start, exc is None, "" if exc is None else _reason(exc))

    async def _dispatch(self, request: InferRequest) -> dict[str, np.ndarray]:
        if self.runner is not None:
            try:
                return await self.runner.run(request)
            finally:  # an ensemble's compute is its steps' own: none of its own
                self._executed(request, 0)
        if self.async_model is not None:
            start = time.perf_counter_ns()
            try:
                return await self.async_model.infer(request)
            finally:  # failed and cancelled executions count too (as the batcher's)
                self._executed(request, time.perf_counter_ns() - start)
        assert self.batcher is not None  # invariant: one of the three serves the version
        return await self.batcher.submit(request)

    def _executed(self, request: InferRequest, infer_ns: int) -> None:
        """One execution outside a batcher (which records its own): statistics and metrics."""
        rows = request.batch_size() or 1
        self.stats.record_execution(rows, 1, 0, infer_ns, 0)
        self.metrics.execution(self.config.name, str(self.version), rows, 0, infer_ns, 0)

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
            if spec is None:  # validate_request admits only declared outputs
                raise KilnError(f"model '{self.config.name}' has no output '{name}'")
            array = np.asarray(outputs[name])
            problem = self._shape_problem(spec, array.shape, request)
            if problem is None:
                array, problem = _as_declared(array, spec.datatype)
            if problem is not None:
                raise KilnError(f"model '{self.config.name}' returned output '{name}' {problem}")
            result[name] = array
        return result

    def _shape_problem(self, spec: TensorSpec, shape: tuple[int, ...], request: InferRequest) -> str | None:
        """Why an output's shape breaks its declaration (dims, behind the batch dim of a
        batched model, which must be the request's batch), or None."""
        declared = list(spec.dims)
        batched = self.config.max_batch_size > 0 and bool(request.inputs)
        if batched:
            declared = [request.batch_size(), *declared]
        if shape_fits(shape, declared):
            return None
        what = f"[{', '.join(map(str, declared))}]" + (" (the first: the request's batch)" if batched else "")
        return f"of shape {list(shape)}; its config declares {what}"

    def queue_size(self) -> int:
        return self.batcher.queue_size() if self.batcher else 0

    def oldest_wait_s(self) -> float:
        return self.batcher.oldest_wait_s() if self.batcher else 0.0

    async def close(self) -> None:
        self.closing = True
        await self._idle.wait()
        if self.batcher is not None:
            await self.batcher.stop()
        if self.async_model is not None:
            await self.async_model.unload()
        await asyncio.to_thread(_unload_all, self.instances)


def _as_declared(array: np.ndarray, datatype: str) -> tuple[np.ndarray, str | None]:
    """An output in its declared datatype, or why it cannot be: text for BYTES; for an
    integer or bool type, no NaN or infinity (a cast would make them arbitrary numbers)."""
    if datatype == "BYTES":
        if array.dtype.kind not in "OSU":
            return array, f"of {array.dtype} values where its config declares BYTES (str or bytes)"
        try:
            return as_bytes_array(array), None
        except TypeError as exc:
            return array, f"that is not all str or bytes: {exc}"
    target = numpy_dtype(datatype)
    if array.dtype == target:
        return array, None
    if array.dtype.kind == "f" and target.kind in "iub" and not np.isfinite(array).all():
        return array, f"with NaN or infinite values, which {datatype} cannot hold"
    try:
        return array.astype(target), None
    except (TypeError, ValueError) as exc:
        return array, f"of {array.dtype} values that are not {datatype}: {exc}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (OverloadedError, RequestTimeoutError)):
        return "REJECTED"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELED"
    if isinstance(exc, (InvalidRequestError, ModelUnavailableError)):
        return "OTHER"
    return "BACKEND"

