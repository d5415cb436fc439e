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

# Decode rows attended as one padded batch: bigger groups pad more keys, smaller ones make more calls.
# Re-tune: bench/decode_step.py (B running requests of mixed context length).
DECODE_GROUP_SIZE = 16

# New tokens on cached context up to which a chunk is attended row by row with the decodes instead of
# one prefill call per sequence; covers verification of up to 16 drafts. Re-tune: bench/spec_decode.py.
MAX_DECODE_LIKE_TOKENS = 17
