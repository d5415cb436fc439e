"""Weight-only quantization: int8 per-channel and int4 group-wise Linear
layers, applied to a loaded model by `quantize_model` (see apply.py)."""
from kiln.llm.quant.apply import QUANTIZATION_METHODS, quantize_model

__all__ = ["QUANTIZATION_METHODS", "quantize_model"]
