"""The model contract every backend (and every user `model.py`) follows.

    class MyModel(Model):
        def load(self, context): ...          # once, before any execute
        def execute(self, requests): ...      # one result per request, same order
        def unload(self): ...                 # once, after the last execute

`execute` gets a list of `InferRequest` (numpy inputs) and returns, for each
request, an `InferResponse`, a plain `{output name: array}` dict, or an
Exception (that request alone fails). Raising fails the whole call.
Each instance is used by one thread at a time (instance_count makes more).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.serving.repository.config import ModelConfig, TensorSpec
from kiln.serving.types import InferRequest, InferResponse

Result = InferResponse | dict[str, np.ndarray] | BaseException


@dataclass(frozen=True)
class LoadContext:
    """What `load` gets: the config, the version and where its files are."""

    config: ModelConfig
    version: int
    version_dir: Path
    instance_index: int = 0


@dataclass
class Timings:
    """Nanoseconds spent in the last execute, split as Triton reports them."""

    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0


class Model:
    """Base class; subclasses override `execute` and optionally the rest."""

    # Filled by backends that split their time (tensor backends); else the
    # caller counts the whole execute as compute_infer.
    timings: Timings | None = None

    def load(self, context: LoadContext) -> None:  # pragma: no cover - default
        pass

    def execute(self, requests: list[InferRequest]) -> list[Result]:
        raise NotImplementedError

    def unload(self) -> None:  # pragma: no cover - default
        pass

    def io_specs(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None:
        """Inputs/outputs read from the artifact, for configs that omit them."""
        return None


@dataclass
class ExecuteStats:
    """Per-call numbers a backend wrapper hands back to the scheduler."""

    batch_size: int
    timings: Timings = field(default_factory=Timings)
    extra: dict[str, Any] = field(default_factory=dict)
