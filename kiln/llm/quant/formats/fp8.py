"""FP8 (e4m3, or e5m2) checkpoints -> float32 weights, dequantized once at load.

Two layouts, per linear layer `P` with a `float8_e4m3fn` (or `float8_e5m2`) `P.weight` [N, K]:

- compressed-tensors (`quant_method` "compressed-tensors", format
  "float-quantized" / "naive-quantized" with float 8-bit weights, as
  llm-compressor writes them): `P.weight_scale` per tensor ([] or [1]), per
  channel ([N, 1]), per group ([N, K/G]) or per block ([ceil(N/bn), ceil(K/bk)],
  `block_structure`); w = weight * scale (compressed-tensors' `dequantize`).
  `P.input_scale` (static activation scales) is dropped: Kiln keeps
  activations in float.
- transformers' "fp8" (`FineGrainedFP8Config`, DeepSeek-V3 style):
  `P.weight_scale_inv` per block of `weight_block_size` (or per tensor), also
  multiplied: w = weight * weight_scale_inv.

Kiln dequantizes to float32 (fp8 to float32 is exact, so is the product
whenever the scale has at most 20 significant bits: bf16 and fp16 scales;
fp32 scales round once, as the reference computed in float32 does) and
computes in the model's dtype, with `--quantization int8|int4` applying as
to any float checkpoint. Keeping fp8 storage would need an fp8 matmul or an
in-kernel fp8 decode, which torch's CPU build and Kiln's kernels lack.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ModelLoadError

# Both OCP FP8 formats: the scale multiplies either the same way (w = weight * scale).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class FP8Spec:
    scale_suffix: str  # "weight_scale" (compressed-tensors) or "weight_scale_inv" (transformers fp8)
    block: tuple[int, int] | None  # rows, cols of a scale block, when the scales are per block
    group_size: int | None  # of per-group scales along the input

    @classmethod
    def from_config(cls, qc: dict[str, Any], source: str) -> FP8Spec:
        method = qc.get("quant_method")
        if method == "fp8":
            block = qc.get("weight_block_size")
            return cls("weight_scale_inv", _block(block, "weight_block_size", source) if block else None, None)
        return _compressed_tensors_spec(qc, source)


def _compressed_tensors_spec(qc: dict[str, Any], source: str) -> FP8Spec:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ModelLoadError(f"{source}: compressed-tensors config_groups must map group names to objects")
    weights = [g.get("weights") or {} for g in groups.values()]
    formats = {str(g.get("format") or qc.get("format") or "") for g in groups.values()} or {str(qc.get("format"))}
    unsupported = formats - {"float-quantized", "naive-quantized"}
    if not unsupported and not any(weights):  # said "format 'float-quantized' is not supported"
        raise ModelLoadError(f"{source}: compressed-tensors config_groups describe no weights")
    if unsupported:
        raise ModelLoadError(
            f"{source}: compressed-tensors format {', '.join(sorted(unsupported or formats))!r} is not supported "
            "(Kiln loads float-quantized FP8 weights)"
        )
    for w in weights:
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ModelLoadError(
                f"{source}: compressed-tensors weights of type {w.get('type')!r} with {w.get('num_bits')} bits are "
                "not supported (Kiln loads 8-bit float weights)"
            )
        if w.get("dynamic"):
            raise ModelLoadError(f"{source}: dynamic weight scales are not supported")
    strategies = {w.get("strategy", "tensor") for w in weights}
    if len(strategies) > 1:
        raise ModelLoadError(f"{source}: several weight strategies {sorted(strategies)} are not supported")
    strategy = strategies.pop()
    if strategy in ("tensor", "channel"):
        return FP8Spec("weight_scale", None, None)
    if strategy == "group":
        group = weights[0].get("group_size")
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
            raise ModelLoadError(f"{source}: compressed-tensors group strategy needs a positive group_size, "
                                 f"got {group!r}")
        return FP8Spec("weight_scale", None, group)
    if strategy == "block":
        return FP8Spec("weight_scale", _block(weights[0].get("block_structure"), "block_structure", source), None)
    raise ModelLoadError(f"{source}: compressed-tensors weight strategy {strategy!r} is not supported")


def _block(value: Any, key: str, source: str) -> tuple[int, int]:
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ModelLoadError(f"{source}: {key} must be [rows, cols] of positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, spec: FP8Spec, name: str) -> torch.Tensor:
    """float32 [N, K] = weight * scale, the scale broadcast by the layout."""
    w, s = weight.float(), scale.float()
    n, k = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if spec.block is not None:
        bn, bk = spec.block
        expected: tuple[int, ...] = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) == expected:
            full = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
            return w * full
    elif spec.group_size is not None:
        expected = (n, k // spec.group_size)
        if k % spec.group_size == 0 and tuple(s.shape) == expected:
            return (w.reshape(n, k // spec.group_size, spec.group_size) * s[..., None]).reshape(n, k)
    else:
        expected = (n, 1)
        if s.numel() == n:
            return w * s.reshape(n, 1)
    raise ModelLoadError(
        f"{name}: FP8 scale of shape {tuple(s.shape)} does not fit weight [{n}, {k}] (expected {expected})"
    )
