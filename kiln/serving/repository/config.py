"""The per-model `config.yaml`: frozen pydantic models, unknown keys rejected.

A config that passes `RepositoryModelConfig.model_validate` is internally consistent;
checks that need other models (ensemble DAGs) or the artifact itself (ONNX
inputs) happen at load time.
"""
from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.errors import ConfigError
from kiln.serving.types import DATATYPES

BACKENDS = ("onnxruntime", "torch", "python", "llm", "ensemble")
# Model names: a path component that cannot traverse (no '/', no leading '.').
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
# Artifact file names: one component, no separators.
FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


def check_model_name(name: str) -> str:
    """Return `name` if it is a safe model name, else raise ConfigError."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise ConfigError(
            f"invalid model name {name!r}: use letters, digits, '_', '-', '.' "
            "(no path separators or '..')",
            param="name",
        )
    return name


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def known_datatype(value: str) -> str:
    if value not in DATATYPES:
        raise ValueError(f"datatype {value!r} is not one of {list(DATATYPES)}")
    return value


class TensorSpec(_Frozen):
    """An input or output: dims exclude the batch dim; -1 = variable."""

    name: str = Field(min_length=1, max_length=256)
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False  # inputs only: may be omitted by the client

    @field_validator("datatype")
    @classmethod
    def _datatype(cls, value: str) -> str:
        return known_datatype(value)

    @field_validator("dims")
    @classmethod
    def _dims(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < -1 or d == 0 for d in value):
            raise ValueError("dims must be positive or -1 (variable)")
        return value


class DynamicBatching(_Frozen):
    """How requests are grouped. `variable_shapes`: requests whose shapes
    differ in a -1 dim are run in separate batches ('split') or zero-padded
    to the largest ('pad'); padded outputs listed in `trim_outputs` are cut
    back along the same axes."""

    # The longest a batch waits for more requests; it leaves earlier when waiting would gather
    # nobody (kiln/serving/batching/wait_policy.py).
    max_queue_delay_ms: float = Field(default=0.0, ge=0, le=60_000)
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = Field(default=0, ge=0)  # 0 = unbounded
    default_timeout_ms: float = Field(default=0.0, ge=0)  # 0 = none
    priority_aging_s: float = Field(default=10.0, ge=0)  # queue order by `priority`: see batcher.py
    variable_shapes: Literal["split", "pad"] = "split"
    pad_value: float = 0.0
    trim_outputs: tuple[str, ...] = ()

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _preferred(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(v < 1 for v in value):
            raise ValueError("preferred_batch_sizes must be positive")
        return tuple(sorted(set(value)))


class QueuePolicy(_Frozen):
    """Queue limits for models without dynamic batching."""

    max_queue_size: int = Field(default=0, ge=0)
    default_timeout_ms: float = Field(default=0.0, ge=0)
    priority_aging_s: float = Field(default=10.0, ge=0)  # queue order by `priority`: see batcher.py


class VersionPolicy(_Frozen):
    """Exactly one of: latest N (default 1), all, specific versions."""

    latest: int | None = Field(default=None, ge=1)
    all: bool | None = None
    specific: tuple[int, ...] | None = None

    @model_validator(mode="after")
    def _one(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) not in (None, False)]
        if len(chosen) > 1:
            raise ValueError(f"version_policy takes one of latest/all/specific, got {chosen}")
        if self.specific is not None and any(v < 1 for v in self.specific):
            raise ValueError("specific versions must be positive")
        return self

    def select(self, available: list[int]) -> list[int]:
        """The versions to load, ascending."""
        available = sorted(available)
        if self.all:
            return available
        if self.specific is not None:
            return [v for v in available if v in self.specific]
        return available[-(self.latest or 1):]


# Warm-up tensors are allocated in full at load time, so a typo in `dims` could ask
# for terabytes (a MemoryError, or a host brought to its knees). 2**26 elements is
# 256 MiB of FP32 per input: more than any warm-up needs.
MAX_WARMUP_ELEMENTS = 1 << 26


class WarmupInput(_Frozen):
    """One warm-up tensor: a concrete shape (no -1), batch dim excluded."""

    datatype: str
    dims: tuple[int, ...]
    data: Literal["zero", "random"] = "zero"

    @field_validator("datatype")
    @classmethod
    def _datatype(cls, value: str) -> str:
        return known_datatype(value)

    @field_validator("dims")
    @classmethod
    def _dims(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        # The tensor is built from these dims, so each must be a real size.
        bad = [d for d in value if d < 1]
        if bad:
            raise ValueError(f"dims {list(value)} must all be positive (warm-up shapes are concrete), got {bad}")
        return value


class Warmup(_Frozen):
    name: str = "warmup"
    batch_size: int = Field(default=1, ge=1)
    count: int = Field(default=1, ge=1, le=1000)
    inputs: dict[str, WarmupInput]

    @model_validator(mode="after")
    def _bounded(self) -> Warmup:
        for name, spec in self.inputs.items():
            elements = self.batch_size * math.prod(spec.dims)
            if elements > MAX_WARMUP_ELEMENTS:
                raise ValueError(
                    f"input {name!r} has batch_size {self.batch_size} x dims {list(spec.dims)} = "
                    f"{elements} elements, more than the warm-up limit of {MAX_WARMUP_ELEMENTS}"
                )
        return self


class EnsembleStep(_Frozen):
    """One step: `input_map` maps the step model's input -> ensemble tensor;
    `output_map` maps the step model's output -> ensemble tensor."""

    model: str
    version: int | None = Field(default=None, ge=1)  # None: the member's highest loaded version
    input_map: dict[str, str]
    output_map: dict[str, str]

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if not NAME_RE.match(value) or ".." in value:
            raise ValueError(f"invalid model name {value!r}")
        return value


ParamValue = bool | int | float | str

# Settings a backend has no use for: an ensemble runs its steps' models (their queues,
# batchers and instances); an llm model queues and batches in its engine, on the engine's device.
IGNORED_BY = {
    "ensemble": {"dynamic_batching", "queue", "instance_count", "max_inline_ms", "warmup", "artifact", "device"},
    "llm": {"queue", "max_inline_ms", "warmup", "artifact", "device"},
}
IGNORED_WHY = {
    "ensemble": "its steps run on their own models' queues, batchers and instances",
    "llm": "its engine queues and batches the requests; its device is parameters.device",
}


class RepositoryModelConfig(_Frozen):
    """One model's config.yaml."""

    name: str
    backend: Literal["onnxruntime", "torch", "python", "llm", "ensemble"]
    max_batch_size: int = Field(default=0, ge=0, le=1 << 16)
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    queue: QueuePolicy = QueuePolicy()
    instance_count: int = Field(default=1, ge=1, le=64)
    # A batch its model's recent calls predict under this runs on the event loop thread
    # (batching/inline.py); 0: always on the instance's thread, for a model whose time
    # varies by request (one slow inline call holds every request and probe meanwhile).
    max_inline_ms: float = Field(default=0.5, ge=0, le=1000)
    version_policy: VersionPolicy = VersionPolicy()
    warmup: tuple[Warmup, ...] = ()
    artifact: str | None = None  # file name inside the version dir
    device: Literal["cpu", "cuda"] = "cpu"
    parameters: dict[str, ParamValue] = {}
    steps: tuple[EnsembleStep, ...] = ()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value) or ".." in value:
            raise ValueError("invalid model name: use letters, digits, '_', '-', '.'")
        return value

    @field_validator("artifact")
    @classmethod
    def _artifact(cls, value: str | None) -> str | None:
        if value is not None and (not FILE_RE.match(value) or ".." in value):
            raise ValueError("artifact must be a plain file name inside the version directory")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RepositoryModelConfig:
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate {kind} names in {names}")
        if any(s.optional for s in self.outputs):
            raise ValueError("outputs cannot be optional")
        if self.backend == "ensemble":
            if not self.steps:
                raise ValueError("an ensemble needs at least one step")
            if not self.inputs or not self.outputs:
                raise ValueError("an ensemble must declare its inputs and outputs")
        elif self.steps:
            raise ValueError("steps are only valid for backend 'ensemble'")
        if self.backend == "llm" and (self.instance_count != 1 or self.dynamic_batching is not None):
            raise ValueError("the llm backend batches inside its engine: use instance_count 1 and no dynamic_batching")
        idle = sorted(IGNORED_BY.get(self.backend, set()) & self.model_fields_set)
        if idle:  # accepted and then ignored, they would mislead
            raise ValueError(f"{', '.join(idle)} {'does' if len(idle) == 1 else 'do'} nothing for backend "
                             f"'{self.backend}' ({IGNORED_WHY[self.backend]})")
        if self.dynamic_batching is not None and self.max_batch_size < 1:
            raise ValueError("dynamic_batching needs max_batch_size >= 1")
        if self.dynamic_batching is not None:
            too_big = [p for p in self.dynamic_batching.preferred_batch_sizes if p > self.max_batch_size]
            if too_big:
                raise ValueError(f"preferred_batch_sizes {too_big} exceed max_batch_size")
        problems = warmup_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def has_io(self) -> bool:
        return bool(self.inputs) and bool(self.outputs)

    def input(self, name: str) -> TensorSpec | None:
        return next((s for s in self.inputs if s.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((s for s in self.outputs if s.name == name), None)


def warmup_problems(config: RepositoryModelConfig) -> list[str]:
    """Every way the warm-up entries disagree with the model's batch size and inputs.

    A config may leave its inputs to the artifact (ONNX); then only the batch size
    is checked here, and the load checks again once the inputs are known
    (`check_warmup`)."""
    problems = []
    for index, warmup in enumerate(config.warmup):
        where = f"warmup[{index}] ({warmup.name!r})"
        problems += [f"{where}: {p}" for p in _warmup_batch_problems(config, warmup)]
        if config.inputs:
            problems += [f"{where}: {p}" for p in _warmup_input_problems(config, warmup)]
    return problems


def check_warmup(config: RepositoryModelConfig) -> None:
    """Raise ConfigError if the warm-up does not fit `config` (one with its inputs
    resolved from the artifact): a bad warm-up is the config's fault, not the server's."""
    problems = warmup_problems(config)
    if problems:
        raise ConfigError(f"invalid config for model '{config.name}': {'; '.join(problems)}", param="warmup")


def _warmup_batch_problems(config: RepositoryModelConfig, warmup: Warmup) -> list[str]:
    if config.max_batch_size == 0 and warmup.batch_size != 1:
        # Without batching the warm-up tensors get no batch dim, so the size would be ignored.
        return [f"batch_size {warmup.batch_size} needs max_batch_size >= 1 (the model does not batch)"]
    if config.max_batch_size and warmup.batch_size > config.max_batch_size:
        return [f"batch_size {warmup.batch_size} exceeds max_batch_size {config.max_batch_size}"]
    return []


def _warmup_input_problems(config: RepositoryModelConfig, warmup: Warmup) -> list[str]:
    problems = []
    for name, given in warmup.inputs.items():
        spec = config.input(name)
        if spec is None:
            problems.append(f"input {name!r} is not an input of the model {[s.name for s in config.inputs]}")
        elif given.datatype != spec.datatype:
            problems.append(f"input {name!r} data-type is {given.datatype!r}, but the model expects {spec.datatype!r}")
        elif not _dims_fit(given.dims, spec.dims):
            problems.append(f"input {name!r} dims {list(given.dims)} do not fit the model's dims {list(spec.dims)}")
    missing = [s.name for s in config.inputs if not s.optional and s.name not in warmup.inputs]
    if missing:
        problems.append(f"required input(s) {missing} missing")
    return problems


def _dims_fit(dims: tuple[int, ...], spec_dims: tuple[int, ...]) -> bool:
    """Whether concrete `dims` fit a spec's dims (-1 takes any size)."""
    return len(dims) == len(spec_dims) and all(s in (-1, d) for d, s in zip(dims, spec_dims, strict=True))


def parse_config(data: Any, *, name: str) -> RepositoryModelConfig:
    """Validate a config mapping for model `name` (the directory name).

    `name` may be omitted in the file; if given it must equal the directory.
    Raises ConfigError with every problem pydantic found, one per line.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config for model '{name}' must be a mapping, got {type(data).__name__}")
    if data.get("name", name) != name:
        raise ConfigError(f"config name {data.get('name')!r} does not match model directory {name!r}")
    try:
        return RepositoryModelConfig.model_validate({**data, "name": name})
    except ValidationError as exc:
        raise ConfigError(f"invalid config for model '{name}': {format_validation_error(exc)}") from None


def format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
