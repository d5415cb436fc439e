"""Where each of a model's parameters comes from in a checkpoint.

A `WeightMap` is a family's whole weight naming in one value: Kiln
parameter name (as `model.named_parameters()` spells it) -> the checkpoint
tensors (Hugging Face names, as transformers writes that family) that are
concatenated along dim 0 to make it. Kiln fuses q|k|v and gate|up, so those
parameters have several sources; a checkpoint that stores them fused (Phi-3)
has one. Loading, the shape check of a checkpoint and the mapping of
pre-quantized tensors onto Kiln's fused Linears all read this.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """Checkpoint tensors `names` with `shapes`, concatenated along dim 0; `offset`
    added to the result (Gemma's norms hold w for a (1 + w) multiply: 1.0)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offset: float = 0.0


class WeightMap(dict[str, Source]):
    def add(self, param: str, *tensors: tuple[str, tuple[int, ...]], offset: float = 0.0) -> None:
        """`param` is the concatenation of `tensors` ((name, shape) pairs)."""
        self[param] = Source(tuple(n for n, _ in tensors), tuple(s for _, s in tensors), offset)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this map reads -> its shape."""
        return {n: s for src in self.values() for n, s in zip(src.names, src.shapes, strict=True)}
