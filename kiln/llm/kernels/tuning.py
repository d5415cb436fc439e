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

# Rows above which an int4 Linear (Kiln's CPU format) with fp32 activations runs kiln::linear_w4_panels (an
# outer-product GEMM on panels of widened weights; other bits than the int4 kernel's) instead of the int4
# kernel (one chain of eight partial sums per output, the bits of every decode batch up to here: the fused
# decode layers take steps of up to this many rows, fused_decode.row_limit). Above 8 rows the kernel widens a
# tile of weight rows once per call into an L1/L2 buffer and runs the fp32 micro-kernel on it (the AVX-512
# builds: lane-major panels, lane_panels.h, within 0.92-1.0x of the panels at 192-2048 rows on Ice Lake,
# 2026-12-06; so the boundary stays here, where the decode steps end); SmolLM2's four
# int4 shapes summed, Zen 3, kernel / widened+oneDNN (the path above this before linear_w4_panels):
# 0.57-0.71x at 64 rows, 0.72-0.84x at 128, 0.80-0.94x at 192, 0.93-1.08x at 256 (1 and 2 threads, three
# runs). The panels ran 160-177 GFLOP/s from 193 rows, 2 threads, Zen 3 (2026-12-05). Re-tune:
# bench/int4_prefill.py.
INT4_DEQUANT_MIN_ROWS = 192

# fp32 rows up to which a GGUF Q8_0 LM head multiplies its int8 blocks (kiln::linear_q8_0, a third of the
# float head's bytes); above, the float head it is bit-identical to (linear_f32, or the packed copy above
# PACKED_MIN_ROWS). The Q8_0 kernel converts every code for every pass of rows, so it is bound by compute
# once the rows cover the bytes it saves. SmolLM2's head (49152 x 576), AMD EPYC Zen 1, 2 threads, ms,
# linear_q8_0 / linear_f32: 1 row 3.19 / 5.29; 4: 5.56 / 6.80; 6: 7.67 / 7.77; 7: 8.57 / 7.94; 8: 10.2 / 9.3;
# 9: 14.2 / 9.5; 16: 22.2 / 14.8; 32: 48.0 / 33.3 (2026-12-03). Re-tune: bench/q8_0_head.py. The avx512(_vnni)
# builds run linear_q8_0 above 8 rows as lane panels (blocks widened once per call; Ice Lake, 2 threads, ms
# against oneDNN on the packed float head: 16 rows 6.45 / 7.84, 32: 9.35 / 9.86, 64: 15.4 / 14.8, 256: 56.3 /
# 53.8), so there an fp32 head takes its blocks at every row count and this limit does not apply.
Q8_0_HEAD_MAX_ROWS = 6

# An int4 Linear with bf16 activations, on a CPU with bf16 dot products: up to INT4_BF16_DEQUANT_MIN_ROWS
# rows Kiln's bf16 kernel (kiln::linear_w4_bf16: up to 8 rows the weights widened to bf16 in registers,
# above that a tile of weight rows widened into a buffer and reused by every row); above it the whole
# weight widened to bf16 in memory (kiln::dequantize_w4) and oneDNN's bf16 GEMM. SmolLM2's 30 layers of
# int4 projections, Zen 4 (AVX512_BF16), 2 threads, ms, fp32 int4 kernel / tiled bf16 / widened +
# oneDNN: 8 rows 17.8-20.0 / 23.6-26.2 / 30.6-39.4; 9: 33.2 / 25.3 / 32.7; 16: 50.8 / 32.7 / 45.9; 64:
# 150.1 / 74.6 / 105.1; 128: 213.3-300.9 / 105.2-134.8 / 100.5-138.5; 144: 252.4 / 131.6 / 109.9; 256:
# 528.6 / 240.3 / 205.5 (2026-12-03; a pass over all 30 layers, weights streamed from memory as in a
# model). In registers against the fp32 int4 kernel, same passes: 1 row 7.30 / 7.76, 2: 7.25 / 8.53, 4:
# 7.04 / 8.29, 8: 13.33 / 16.01 (2026-12-04). bench/int4_prefill.py --threads 2 --dtype bfloat16 --rows
# 8,9,16,64,128 times one layer of each shape, its weights cache-resident, which favours widening in
# memory: there oneDNN led from 64 rows (2.17 vs 2.55 ms).
INT4_BF16_DEQUANT_MIN_ROWS = 128

# Rows from which a bf16 model's int4 lane projection (kiln::linear_w4l_bf16) runs oneDNN on its packed bf16
# copy instead, where `--int4-prefill-weights` kept one oneDNN-packed (CPUs with AMX; elsewhere the copy is in
# lane layout and steps of 16+ rows take it: kLaneCopyMinRows, linear_w4l_bf16.cpp, kiln/llm/quant/int4_lanes.py,
# measured in linear_bf16_lanes.cpp). The lane kernel applies
# each group's scale and min in fp32 (two FMAs per sixteen vdpbf16ps per output vector: removing them, for a
# ceiling only, made it 1.13x faster), so from ~100 rows oneDNN's packed GEMM on the rounded weights wins.
# SmolLM2's 120 lane projections, AMD EPYC Zen 4, 2 threads, GFLOP/s lanes / packed: 32 rows 305 / 238;
# 64: 351 / 337; 96: 356 / 363; 128: 341 / 358; 256: 362 / 405; 300: 357-368 / 383-412; 1024: 361-367 /
# 407-425; 2048: 349-350 / 415-417 (2026-12-05; the peak of vdpbf16ps there: 469). Re-tune: a pass of the
# projections at those rows, docs/benchmarks.md ("A bf16 copy of the int4 projections for prompts").
INT4_LANES_PACKED_MIN_ROWS = 128

# Decode rows attended as one padded batch: bigger groups pad more keys, smaller ones make more calls.
# The fused decode layers ignore the groups (one call over every row: Kiln's kernel reads exact contexts).
# Re-tune: bench/decode_step.py (B running requests of mixed context length).
DECODE_GROUP_SIZE = 16

# Generated tokens on cached context up to which a chunk is attended row by row with the decodes instead of
# one prefill call per sequence (a prompt's tail never is: runner/inputs.py is_decode_like); covers verification
# of up to 16 drafts. Re-tune: bench/spec_decode.py.
MAX_DECODE_LIKE_TOKENS = 17

# bf16 weights (bench/linear_bf16.py --cpu-time, Zen 4): Kiln's AVX512_BF16 kernel beats oneDNN's packed bf16
# weights up to 8 rows and loses from 16, so more than BF16_PACKED_MIN_ROWS rows take the packed copy where a
# layer has one (and the fused decode layer takes at most that many); without one, Kiln's kernel beats torch's
# F.linear up to 32 rows and loses at 64 (BF16_LINEAR_MAX_ROWS). Re-tune: bench/linear_bf16.py.
BF16_LINEAR_MAX_ROWS = 48
BF16_PACKED_MIN_ROWS = 8
