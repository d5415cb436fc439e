"""Pre-quantized checkpoint formats read into Kiln's quantized layouts.

GPTQ and AWQ 4-bit (gptq.py, awq.py) and GGUF Q4_0 / Q4_1 / Q4_K
(gguf_blocks.py) map onto Kiln's int4 layout exactly (int4_weight.py);
FP8 (fp8.py) is dequantized once at load. hf.py reads `quantization_config`;
stored.py is the hook through which loaders hand quantized projections to
model code, by Hugging Face weight name.
"""
