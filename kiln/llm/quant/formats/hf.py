"""Pre-quantized Hugging Face checkpoints: `quantization_config` in config.json.

`split_prequantized` turns a directory's stored tensors into float weights
plus the projections that stay quantized, both under the plain HF weight
names (`P.weight`) the model code knows:

    gptq                      -> Int4Weight (gptq.py)
    awq                       -> Int4Weight (awq.py)
    compressed-tensors, fp8   -> float32 (fp8.py: dequantized at load)

Embeddings and the LM head always come out float (the token lookup needs
float rows; the head gets the engine's head quantization, if any). Anything
else is refused with a ModelLoadError naming the method.

A quantized projection's bias (`P.bias`, e.g. Qwen2's q/k/v biases) stays a
float weight: the model adds it after the int4 matmul, in the output dtype,
as it does for a float checkpoint. Quantizers that store a bias for every
projection (AutoGPTQ writes zeros where the model has none) get those all-zero
biases dropped where the architecture reads none (`expected` names the weights
it reads); a non-zero one there is refused, naming it.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import torch

from kiln.errors import ModelLoadError
from kiln.llm.quant.formats import awq, fp8, gptq
from kiln.llm.quant.formats.int4_weight import Int4Weight
from kiln.llm.quant.formats.stored import FLOAT_ONLY

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
# One layer's stored tensors by suffix, and its weight name -> its weight.
Convert = Callable[[dict[str, torch.Tensor], str], "Int4Weight | torch.Tensor"]


def quant_method(config: dict[str, Any]) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None for a float checkpoint."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError("quantization_config in config.json is not an object")
    return str(qc.get("quant_method") or "")


def split_prequantized(
    weights: dict[str, torch.Tensor], config: dict[str, Any], source: str, expected: Collection[str] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, Int4Weight]]:
    """(float weights, quantized projections) by HF name, from a directory's
    stored tensors; `expected`: the names the model's architecture reads (none
    given: every quantized projection's bias is taken as one it has not)."""
    method = quant_method(config)
    if method is None:
        return weights, {}
    qc = config["quantization_config"]
    if method == "gptq":
        spec = gptq.GPTQSpec.from_config(qc, source)
        return _split_int4(weights, gptq.SUFFIXES, lambda t, name: gptq.gptq_weight(t, spec, name), "GPTQ", source,
                           expected)
    if method == "awq":
        awq_spec = awq.AWQSpec.from_config(qc, source)
        return _split_int4(weights, awq.SUFFIXES, lambda t, name: awq.awq_weight(t, awq_spec, name), "AWQ", source,
                           expected)
    if method in ("compressed-tensors", "fp8"):
        return _dequantize_fp8(weights, fp8.FP8Spec.from_config(qc, source), source), {}
    raise ModelLoadError(
        f"{source}: quant_method {method!r} is not supported (Kiln loads {', '.join(METHODS)})"
    )


def _split_int4(
    weights: dict[str, torch.Tensor], suffixes: tuple[str, ...], convert: Convert, label: str, source: str,
    expected: Collection[str],
) -> tuple[dict[str, torch.Tensor], dict[str, Int4Weight]]:
    floats: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in suffixes:
            layers.setdefault(prefix, {})[suffix] = tensor
        elif suffix == "bias" and prefix + ".qweight" in weights and name not in expected:
            if bool(tensor.any()):
                raise ModelLoadError(
                    f"{source}: {name}: a non-zero bias on a projection that has none in this architecture"
                )
        else:
            floats[name] = tensor
    quantized: dict[str, Int4Weight] = {}
    kept: Counter[str] = Counter()
    for prefix, parts in layers.items():
        missing = [s for s in suffixes[:3] if s not in parts]
        if missing:
            raise ModelLoadError(f"{source}: {prefix} lacks {', '.join(missing)}")
        name = prefix + ".weight"
        weight = convert(parts, name)
        if isinstance(weight, Int4Weight) and name not in FLOAT_ONLY:
            quantized[name] = weight
            kept["fp16" if weight.scale_min.dtype == torch.float16 else "fp32"] += 1
        else:
            floats[name] = weight.dequantize() if isinstance(weight, Int4Weight) else weight
    log.info(
        "%s: %d %s projections kept as int4 (scale/min fp16: %d, fp32: %d), %d dequantized to float",
        source, len(quantized), label, kept["fp16"], kept["fp32"], len(layers) - len(quantized),
    )
    return floats, quantized


def _dequantize_fp8(weights: dict[str, torch.Tensor], spec: fp8.FP8Spec, source: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    converted = 0
    for name, tensor in weights.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in (spec.scale_suffix, "input_scale"):
            continue  # read with the weight / not used (Kiln keeps activations in float)
        if suffix == "weight_zero_point":
            if bool(tensor.any()):
                raise ModelLoadError(f"{source}: {name}: asymmetric FP8 is not supported")
            continue
        if suffix == "weight" and fp8.is_fp8(tensor):
            scale = weights.get(f"{prefix}.{spec.scale_suffix}")
            if scale is None:
                raise ModelLoadError(f"{source}: {name} is FP8 without {prefix}.{spec.scale_suffix}")
            out[name] = fp8.dequantize_fp8(tensor, scale, spec, name)
            converted += 1
        else:
            out[name] = tensor
    log.info("%s: %d FP8 weights dequantized to float32 at load", source, converted)
    return out
