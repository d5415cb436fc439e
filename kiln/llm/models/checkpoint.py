"""A loaded model checkpoint: architecture, weights and where its tokenizer is.

Invariant: every Checkpoint that `loader.load_checkpoint` returns has exactly
the weights `expected_weight_shapes(arch)` names, with those shapes, each in
`weights` (float) or `quantized` (a projection read from a pre-quantized
checkpoint in Kiln's quantized layout, kiln.llm.quant.formats), never both.
Weight names are the Hugging Face names of the arch's family (its WeightMap),
whatever the file format was, so model code has one naming scheme per family.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.registry import expected_weight_shapes
from kiln.llm.quant.formats.stored import QuantizedWeight
from kiln.llm.quant.q8_0_head import Q8_0Weight


@dataclass
class Checkpoint:
    arch: ModelArch
    # HF names of the family -> tensors (float32 for GGUF, as stored for safetensors;
    # the model casts to its compute dtype).
    weights: dict[str, torch.Tensor]
    # A HF model directory or a .gguf file: what `load_tokenizer` accepts.
    tokenizer_path: str
    # Human-readable origin (the path loaded), for logs and error messages.
    source: str
    # HF names -> projections kept in their stored quantized form (absent from `weights`).
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    # The LM head's stored Q8_0 blocks (GGUF), beside its float copy in `weights`
    # (which the embedding lookup reads): an fp32 model computes logits from them.
    stored_head: Q8_0Weight | None = None

    @property
    def is_gguf(self) -> bool:
        """Read from a .gguf file (a GGUF checkpoint's tokenizer_path is that file)."""
        return self.tokenizer_path.endswith(".gguf")

    def without_weights(self) -> Checkpoint:
        """This checkpoint's description (arch, tokenizer, source) without its tensors:
        what an engine keeps once its model holds the weights in its own layout."""
        return dataclasses.replace(self, weights={}, quantized={}, stored_head=None)

    def dequantized_weights(self) -> dict[str, torch.Tensor]:
        """Every weight as a float tensor (quantized projections dequantized)."""
        return {**self.weights, **{name: q.dequantize() for name, q in self.quantized.items()}}


def check_weights(
    arch: ModelArch, weights: Mapping[str, torch.Tensor | QuantizedWeight], source: str
) -> None:
    """Raise ModelLoadError unless `weights` (float and quantized) matches `arch` exactly."""
    check_none_missing(arch, weights.keys(), source)
    expected = expected_weight_shapes(arch)
    extra = sorted(weights.keys() - expected.keys())
    if extra:
        raise ModelLoadError(f"{source}: unexpected weights {_preview(extra)}")
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{source}: weight {name} has shape {got}, expected {shape}")


def check_none_missing(arch: ModelArch, names: Iterable[str], source: str) -> None:
    """Raise ModelLoadError if a weight `arch` needs is not among `names`."""
    missing = sorted(expected_weight_shapes(arch).keys() - set(names))
    if missing:
        raise ModelLoadError(f"{source}: missing weights {_preview(missing)}")


def _preview(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


__all__ = ["Checkpoint", "check_none_missing", "check_weights", "expected_weight_shapes"]
