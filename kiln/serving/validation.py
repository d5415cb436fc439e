"""Checks a decoded request against the model's config before it queues.

Invariant: a request that passes has every required input, no unknown
input, each input's datatype and shape as the config declares (plus one
shared batch dim of 1..max_batch_size when the model batches), and only
known, distinct requested outputs. Backends may rely on all of that.
"""
from __future__ import annotations

from kiln.errors import InvalidRequestError
from kiln.serving.repository.config import RepositoryModelConfig, TensorSpec
from kiln.serving.types import InferRequest, datatype_of


def validate_request(request: InferRequest, config: RepositoryModelConfig) -> None:
    _check_names(request, config)
    batch = None
    for spec in config.inputs:
        array = request.inputs.get(spec.name)
        if array is None:
            continue
        given = datatype_of(array)
        if given != spec.datatype:
            raise InvalidRequestError(
                f"inference input '{spec.name}' data-type is '{given}', but model '{config.name}' "
                f"expects '{spec.datatype}'"
            )
        shape = list(array.shape)
        if config.max_batch_size > 0:
            batch = _check_batch(config, spec, shape, batch)
            shape = shape[1:]
        if not shape_fits(shape, spec.dims):
            expected = ([-1] if config.max_batch_size else []) + list(spec.dims)
            raise InvalidRequestError(
                f"unexpected shape for input '{spec.name}' for model '{config.name}'. "
                f"Expected {expected}, got {list(array.shape)}"
            )
    _check_outputs(request, config)


def _check_names(request: InferRequest, config: RepositoryModelConfig) -> None:
    known = {s.name for s in config.inputs}
    unknown = [n for n in request.inputs if n not in known]
    if unknown:
        raise InvalidRequestError(f"unexpected inference input '{unknown[0]}' for model '{config.name}'")
    required = [s.name for s in config.inputs if not s.optional]
    missing = [n for n in required if n not in request.inputs]
    if missing:
        raise InvalidRequestError(
            f"expected {len(required)} inputs but got {len(request.inputs)} inputs for model "
            f"'{config.name}'. Got input(s) {sorted(request.inputs)}, but missing required input(s) "
            f"{missing}. Please provide all required input(s)."
        )


def _check_batch(config: RepositoryModelConfig, spec: TensorSpec, shape: list[int], batch: int | None) -> int:
    if not shape:
        raise InvalidRequestError(
            f"input '{spec.name}' of model '{config.name}' needs a batch dimension (max_batch_size "
            f"{config.max_batch_size})"
        )
    if shape[0] < 1:
        raise InvalidRequestError(
            f"inference request batch-size must be at least 1 for '{config.name}', got {shape[0]} "
            f"(input '{spec.name}' has shape {shape})"
        )
    if shape[0] > config.max_batch_size:
        raise InvalidRequestError(
            f"inference request batch-size must be <= {config.max_batch_size} for '{config.name}', "
            f"got {shape[0]}"
        )
    if batch is not None and shape[0] != batch:
        raise InvalidRequestError(f"inputs of model '{config.name}' have different batch sizes")
    return shape[0]


def shape_fits(shape: list[int] | tuple[int, ...], dims: tuple[int, ...] | list[int]) -> bool:
    """Whether `shape` has `dims`' rank and size wherever a dim is not -1."""
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims, strict=False))


def _check_outputs(request: InferRequest, config: RepositoryModelConfig) -> None:
    if request.outputs is None:
        return
    seen: set[str] = set()
    for output in request.outputs:
        if output.name in seen:
            raise InvalidRequestError(f"output '{output.name}' already exists in request")
        seen.add(output.name)
        if config.output(output.name) is None:
            raise InvalidRequestError(f"unexpected inference output '{output.name}' for model '{config.name}'")
