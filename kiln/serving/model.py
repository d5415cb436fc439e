"""The model contracts backends (and every user `model.py`) follow.

    class MyModel(Model):
        def load(self, context): ...          # once, before any execute
        def execute(self, requests): ...      # one result per request, same order
        def unload(self): ...                 # once, after the last execute

`execute` gets a list of `InferRequest` (numpy inputs) and returns, for each
request, an `InferResponse`, a plain `{output name: array}` dict, or an
Exception (that request alone fails). Raising fails the whole call.
Each instance is used by one thread at a time (instance_count makes more);
the dynamic batcher forms the batches.

`AsyncModel` is for models that batch by themselves (Kiln's LLM engine):
each request goes straight to it on the event loop, with no batcher and
no thread, and it may stream several responses per request.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.serving.repository.config import RepositoryModelConfig, TensorSpec
from kiln.serving.types import InferRequest, InferResponse

Result = InferResponse | dict[str, np.ndarray] | BaseException


@dataclass(frozen=True)
class LoadContext:
    """What `load` gets: the config, the version and where its files are."""

    config: RepositoryModelConfig
    version: int
    version_dir: Path | None  # None: a model given on the command line, not from the repository
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


class AsyncModel:
    """A model that batches by itself; see the module docstring.

    Invariant: `unload` returns only once no request of this model is in
    flight (it drains first), so a version swap never cuts a request.
    """

    async def load(self, context: LoadContext) -> None:
        raise NotImplementedError

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None] | None:
        """Several responses for one request, or None when this request does not stream."""
        return None

    def healthy(self) -> bool:
        return True

    def health_problem(self) -> str:
        """Why the model does not serve now (read only when `healthy()` is False)."""
        return "not healthy"

    async def unload(self) -> None:
        pass

    def io_specs(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None:
        return None
