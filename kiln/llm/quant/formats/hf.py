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
from typing import Any, TypeVar

import torch

from kiln.errors import ModelLoadError
from kiln.llm.quant.formats import awq, fp8, gptq
from kiln.llm.quant.formats.int4_weight import Int4Weight
from kiln.llm.quant.formats.stored import FLOAT_ONLY

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
# One layer's stored tensors by suffix, and its weight name -> its weight.
Spec = TypeVar("Spec")
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
        _refuse_fp8(weights, source, "config.json has no quantization_config")
        return weights, {}
    floats, quantized = _split(weights, method, config["quantization_config"], source, expected)
    if method not in ("compressed-tensors", "fp8"):
        _refuse_fp8(floats, source, f"quant_method {method!r} stores no FP8")
    return floats, quantized


def _refuse_fp8(weights: dict[str, torch.Tensor], source: str, why: str) -> None:
    """FP8 tensors outside an FP8 checkpoint: their scales are unknown (copied in unscaled, or a torch error)."""
    name = next((n for n, t in weights.items() if fp8.is_fp8(t)), None)
    if name is not None:
        raise ModelLoadError(f"{source}: {name} is stored as {weights[name].dtype}, but {why}")


def _split(
    weights: dict[str, torch.Tensor], method: str, qc: dict[str, Any], source: str, expected: Collection[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Int4Weight]]:
    if method == "gptq":
        spec = _spec(lambda: gptq.GPTQSpec.from_config(qc, source), source)
        return _split_int4(weights, gptq.SUFFIXES, lambda t, name: gptq.gptq_weight(t, spec, name), "GPTQ", source,
                           expected)
    if method == "awq":
        awq_spec = _spec(lambda: awq.AWQSpec.from_config(qc, source), source)
        return _split_int4(weights, awq.SUFFIXES, lambda t, name: awq.awq_weight(t, awq_spec, name), "AWQ", source,
                           expected)
    if method in ("compressed-tensors", "fp8"):
        return _dequantize_fp8(weights, _spec(lambda: fp8.FP8Spec.from_config(qc, source), source), source), {}
    raise ModelLoadError(
        f"{source}: quant_method {method!r} is not supported (Kiln loads {', '.join(METHODS)})"
    )


def _spec(read: Callable[[], Spec], source: str) -> Spec:
    """A format's settings from quantization_config; a value of the wrong type or shape is a load error."""
    try:
        return read()
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ModelLoadError(f"{source}: invalid quantization_config in config.json ({type(e).__name__}: {e})") from e


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
        if name in floats:  # one would be dropped in silence; a weight is float or quantized, never both
            raise ModelLoadError(f"{source}: {prefix} is stored both as {name} and as {label} tensors")
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
    # A scale whose weight is not FP8 would be dropped and the weight read unscaled: a wrong model.
    for name in weights:
        prefix, _, suffix = name.rpartition(".")
        weight = weights.get(prefix + ".weight")
        if suffix == spec.scale_suffix and (weight is None or not fp8.is_fp8(weight)):
            stored = "no weight" if weight is None else f"a {weight.dtype} weight"
            raise ModelLoadError(f"{source}: {name} scales {stored}; Kiln reads FP8 weights "
                                 f"({', '.join(str(d) for d in fp8.FP8_DTYPES)}) with their scales")
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
