"""The hook between checkpoint loaders and model code for weights that stay quantized.

A loader hands over two maps keyed by Hugging Face weight names
(`model.layers.0.self_attn.q_proj.weight`): float tensors, and projections
it read as `QuantizedWeight`s. `StoredWeights` gives model code one view of
both: `float(name)` for tensors it needs in float (norms, embeddings: a
quantized one is dequantized), `projection(names)` for a Linear's weight,
fused along the output dimension (q|k|v, gate|up) in quantized form when
every piece is quantized compatibly, else in float.

`LlamaModel.finish` then settles the installed quantized modules for the
device and the configured mode (`settle_prequantized`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.llm.kernels.ops import kernels_loaded
from kiln.llm.layers.linear import Linear
from kiln.llm.quant.formats.int4_weight import Int4Weight, PermutedInput, concat_rows
from kiln.llm.quant.int4 import Int4Linear, int4_supported
from kiln.llm.quant.int4_cpu import Int4CpuLinear, unpack_codes

log = logging.getLogger(__name__)

# Every pre-quantized form Kiln keeps (one, for now: int4 groups).
QuantizedWeight = Int4Weight
# Weights read by row lookup (embeddings) or by the LM head (which gets the
# engine's head quantization, if any): loaders keep these float.
FLOAT_ONLY = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
# Group sizes torch's tinygemm int4 kernels take (CUDA, and CPU without Kiln's kernels).
_TORCH_INT4_GROUPS = (32, 64, 128, 256)


class StoredWeights:
    """A checkpoint's weights by HF name: float tensors plus quantized projections."""

    def __init__(self, weights: Mapping[str, torch.Tensor], quantized: Mapping[str, QuantizedWeight] | None = None):
        self.weights = weights
        self.quantized = quantized or {}

    def names(self) -> set[str]:
        return set(self.weights) | set(self.quantized)

    def float(self, name: str) -> torch.Tensor:
        if name in self.quantized:
            return self.quantized[name].dequantize()
        tensor = self.weights[name]
        if not tensor.is_floating_point():  # copy_ would cast int / bool codes into a wrong model in silence
            raise ModelLoadError(f"weight {name} is stored as {tensor.dtype}; Kiln reads float weights here "
                                 "(quantized tensors need their quantization_config)")
        return tensor

    def projection(self, names: Sequence[str]) -> torch.Tensor | QuantizedWeight:
        """The weights `names` stacked along the output dimension, quantized if
        all of them are and they fuse, else float32 (quantized pieces dequantized)."""
        pieces = [self.quantized[n] for n in names if n in self.quantized]
        if len(pieces) == len(names):
            fused = pieces[0] if len(pieces) == 1 else concat_rows(pieces)
            if fused is not None:
                return fused
        if pieces:
            log.info("%s: stored as %s, fused with unlike pieces: dequantized to float", ", ".join(names),
                     "/".join(dict.fromkeys(p.source for p in pieces)))
        floats = [self.float(n) for n in names]
        return floats[0] if len(floats) == 1 else torch.cat(floats)


def is_prequantized(module: nn.Module) -> bool:
    return isinstance(module, (Int4CpuLinear, PermutedInput))


def settle_prequantized(model: nn.Module, device: torch.device, keep: bool) -> None:
    """Before the model moves to `device`: every installed pre-quantized
    projection becomes a float `Linear` (keep=False: the caller wants float or
    its own quantization), or, where Kiln's CPU kernel does not run (another
    device, library not built), torch's int4 kernel with its bf16
    scale/zero (close to, not bit-equal to, the stored weights)."""
    native = device.type == "cpu" and kernels_loaded()
    approximated = dequantized = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not is_prequantized(child) or (keep and native):
                continue
            replacement = _torch_int4(child, device) if keep else None
            approximated += replacement is not None
            if replacement is None:
                replacement = _float_linear(child)
                dequantized += 1
            setattr(parent, name, replacement)
    if keep and approximated:
        log.warning("%d pre-quantized int4 projections run torch's int4 kernel on %s (bf16 scale/zero)",
                    approximated, device)
    if keep and dequantized:
        log.warning("%d pre-quantized projections dequantized to float: no int4 kernel for them on %s",
                    dequantized, device)


def _float_linear(module: nn.Module) -> Linear:
    weight = _dequantized(module)
    linear = Linear(weight.shape[1], weight.shape[0])
    linear.weight.data = weight
    return linear


def _dequantized(module: nn.Module) -> torch.Tensor:
    if isinstance(module, PermutedInput):
        w = _dequantized(module.inner)
        out = torch.empty_like(w)
        out[:, module.perm] = w
        return out
    if not isinstance(module, Int4CpuLinear):
        raise TypeError(f"not a pre-quantized projection: {type(module).__name__}")
    return module.dequantized_weight()


def _torch_int4(module: nn.Module, device: torch.device) -> nn.Module | None:
    inner = module.inner if isinstance(module, PermutedInput) else module
    if not isinstance(inner, Int4CpuLinear):
        raise TypeError(f"not a pre-quantized projection: {type(module).__name__}")
    g = inner.group_size
    if g not in _TORCH_INT4_GROUPS or not int4_supported(inner.in_features, inner.out_features, g, device):
        return None
    sm = inner.scale_min.float()  # [N, K/G, 2]
    scales = sm[..., 0].t().contiguous()
    zeros = (sm[..., 1] + 8.0 * sm[..., 0]).t().contiguous()  # tinygemm: (q - 8) * scale + zero
    layer = Int4Linear.from_codes(unpack_codes(inner.codes.cpu()), scales, zeros, g, device, torch.bfloat16)
    if isinstance(module, PermutedInput):
        return PermutedInput(module.perm.to(device), layer)
    return layer
