"""Joining requests along the batch dimension and splitting results back.

Invariant: `split_outputs(run(concat_inputs(rs)))` gives each request exactly
the rows it contributed, in order; padded axes are cut back only for outputs
the config names in `trim_outputs`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.serving.types import InferRequest


@dataclass
class Batch:
    inputs: dict[str, np.ndarray]
    sizes: list[int]  # rows contributed by each request
    shapes: list[tuple[int, ...]]  # each request's first-input shape before padding


def same_shapes(a: InferRequest, b: InferRequest) -> bool:
    """True if two requests can be concatenated without padding."""
    if a.inputs.keys() != b.inputs.keys():
        return False
    return all(
        a.inputs[k].shape[1:] == b.inputs[k].shape[1:] and a.inputs[k].dtype == b.inputs[k].dtype
        for k in a.inputs
    )


def same_layout(a: InferRequest, b: InferRequest) -> bool:
    """True if two requests can be concatenated after padding (same ranks)."""
    if a.inputs.keys() != b.inputs.keys():
        return False
    return all(a.inputs[k].ndim == b.inputs[k].ndim and a.inputs[k].dtype == b.inputs[k].dtype for k in a.inputs)


def _pad_to(array: np.ndarray, shape: tuple[int, ...], value: float) -> np.ndarray:
    if array.shape[1:] == shape:
        return array
    widths = [(0, 0)] + [(0, want - have) for have, want in zip(array.shape[1:], shape, strict=False)]
    if array.dtype == object:
        return np.pad(array, widths, constant_values=b"")
    return np.pad(array, widths, constant_values=value)


def concat_inputs(requests: list[InferRequest], pad_value: float | None = None) -> Batch:
    """Concatenate every input along axis 0 (padding first if `pad_value`)."""
    names = list(requests[0].inputs)
    sizes = [r.batch_size() for r in requests]
    shapes = [tuple(next(iter(r.inputs.values())).shape) for r in requests]
    if len(requests) == 1:
        return Batch(dict(requests[0].inputs), sizes, shapes)
    merged = {}
    for name in names:
        parts = [r.inputs[name] for r in requests]
        if pad_value is not None:
            target = tuple(int(max(s)) for s in zip(*(p.shape[1:] for p in parts), strict=False))
            parts = [_pad_to(p, target, pad_value) for p in parts]
        merged[name] = np.concatenate(parts, axis=0)
    return Batch(merged, sizes, shapes)


def split_outputs(outputs: dict[str, np.ndarray], batch: Batch, trim: tuple[str, ...] = ()) -> list[dict]:
    """Split each output's rows back per request; trim padded axes if asked."""
    rows = sum(batch.sizes)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != rows:
            raise ValueError(f"output '{name}' has {array.shape[0] if array.ndim else 0} rows but the batch had {rows}")
    if len(batch.sizes) == 1:  # a lone request: all rows are its own, and it was padded to nothing
        return [dict(outputs)]
    results: list[dict] = [{} for _ in batch.sizes]
    offsets = np.cumsum([0] + batch.sizes)
    padded = tuple(max(s[k] for s in batch.shapes) for k in range(len(batch.shapes[0])))
    for name, array in outputs.items():
        for i in range(len(batch.sizes)):
            part = array[offsets[i]:offsets[i + 1]]
            if name in trim:
                part = _trim(part, padded, batch.shapes[i])
            results[i][name] = part
    return results


def _trim(part: np.ndarray, padded: tuple[int, ...], original: tuple[int, ...]) -> np.ndarray:
    index = [slice(None)]
    for axis in range(1, part.ndim):
        if axis < len(padded) and part.shape[axis] == padded[axis]:
            index.append(slice(0, original[axis]))
        else:
            index.append(slice(None))
    return part[tuple(index)]
