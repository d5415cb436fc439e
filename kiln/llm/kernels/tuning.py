"""Thresholds tuned by measurement on one CPU, in one place.

Each constant says what it trades and which bench/ script re-tunes it; the
figures behind the current values are in docs/benchmarks.md. Another CPU may
want other values: rerun the script there and change them here only.
"""

# fp32 rows up to which Kiln's linear kernel (weights streamed once for all rows) beats torch's BLAS;
# more rows go to MKL/oneDNN. Re-tune: bench/linear_f32.py (Kiln vs MKL crossover).
LINEAR_MAX_ROWS = 192

# fp32 rows above which a layer with a oneDNN-packed weight copy (and the LM head) runs oneDNN instead
# of Kiln's kernel; also the largest decode step the fused decode layer takes. Re-tune: bench/linear_f32.py.
PACKED_MIN_ROWS = 32

# Rows above which an int4 Linear (Kiln's CPU format) widens its whole weight to fp32 (kiln::dequantize_w4),
# packs it and runs oneDNN instead of the int4 kernel. Above 8 rows the kernel widens a tile of weight rows
# once per call into an L1/L2 buffer and runs the fp32 micro-kernel on it; SmolLM2's four int4 shapes summed,
# Zen 3, kernel / widened+oneDNN: 0.57-0.71x at 64 rows, 0.72-0.84x at 128, 0.80-0.94x at 192, 0.93-1.08x
# at 256 (1 and 2 threads, three runs). Re-tune: bench/int4_prefill.py.
INT4_DEQUANT_MIN_ROWS = 192

# Rows above which an int4 Linear with bf16 activations, on a CPU with bf16 dot products, widens its whole
# weight to bf16 (kiln::dequantize_w4) and runs oneDNN's bf16 GEMM instead of the fp32 int4 kernel.
# SmolLM2's four int4 shapes summed, Zen 4 (AVX512_BF16), 2 threads, kernel / widened: 0.40x at 8 rows,
# 0.84x at 12, 0.90x at 16, 1.09x at 24, 1.24x at 32, 1.21x at 64, 2.15x at 256, 2.74x at 1024; the 30
# layers in turn (weights out of cache): 1.0-1.06x at 16, 1.65x at 32 (2026-12-03). Re-tune:
# bench/int4_prefill.py --threads 2 --dtype bfloat16 --rows 8,12,16,24,32,64.
INT4_BF16_WIDEN_MIN_ROWS = 16

# Decode rows attended as one padded batch: bigger groups pad more keys, smaller ones make more calls.
# Re-tune: bench/decode_step.py (B running requests of mixed context length).
DECODE_GROUP_SIZE = 16

# New tokens on cached context up to which a chunk is attended row by row with the decodes instead of
# one prefill call per sequence; covers verification of up to 16 drafts. Re-tune: bench/spec_decode.py.
MAX_DECODE_LIKE_TOKENS = 17

# bf16 weights (bench/linear_bf16.py --cpu-time, Zen 4): Kiln's AVX512_BF16 kernel beats oneDNN's packed bf16
# weights up to 8 rows and loses from 16, so more than BF16_PACKED_MIN_ROWS rows take the packed copy where a
# layer has one (and the fused decode layer takes at most that many); without one, Kiln's kernel beats torch's
# F.linear up to 32 rows and loses at 64 (BF16_LINEAR_MAX_ROWS). Re-tune: bench/linear_bf16.py.
BF16_LINEAR_MAX_ROWS = 48
BF16_PACKED_MIN_ROWS = 8
