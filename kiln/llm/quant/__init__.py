"""Weight-only quantization: int8 per-channel and int4 group-wise Linear
layers, put in place of a loaded model's projections (see apply.py and
LlamaModel.finish)."""
