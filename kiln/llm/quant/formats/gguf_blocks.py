"""GGUF (llama.cpp) quantized blocks -> Kiln's int4 layout, without a float round trip.

Block layouts (ggml-common.h; every row of a tensor is whole blocks, little-endian):

    Q4_0  32 weights, 18 bytes: fp16 d, 16 bytes of codes      w = (q - 8) * d
    Q4_1  32 weights, 20 bytes: fp16 d, fp16 m, 16 bytes       w = q * d + m
    Q4_K  256 weights, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit
          (sc, m) for 8 sub-blocks of 32, 128 bytes of codes   w = q * (d * sc) - dmin * m

Codes: in a 32-weight block (Q4_0/Q4_1) byte j holds weight j in its low
nibble and weight j + 16 in its high one; in Q4_K each 32-byte chunk c holds
sub-block 2c in the low nibbles and 2c + 1 in the high ones.

All three are Kiln's w = q * scale + min with groups of 32: Q4_0 scale d,
min -8d; Q4_1 scale d, min m (both exact in fp16); Q4_K scale d * sc, min
-(dmin * m), exact in fp32 (11-bit d times 6-bit sc), so int4_weight keeps
those in fp32. Computed in float32, q * scale + min then equals the gguf
package's dequantization bit for bit (q * scale is exact; one rounding at
the addition, as in gguf's (d * q) + m).

Other types (Q8_0: one scale per 32 int8 weights, where Kiln's int8 has one
per row; Q5_x, Q6_K: 5-6-bit codes) have no exact Kiln layout: the loader
dequantizes them and says so in its log.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kiln.llm.quant.formats.int4_weight import Int4Weight, int4_weight, layout_fits

GROUP = 32
Q4_K_BLOCK = 256
_BLOCK_BYTES = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q4_K: 144,
}
_BLOCK_WEIGHTS = {GGMLQuantizationType.Q4_0: 32, GGMLQuantizationType.Q4_1: 32, GGMLQuantizationType.Q4_K: 256}
EXACT_INT4_TYPES = frozenset(_BLOCK_BYTES)


def gguf_int4_weight(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> Int4Weight | None:
    """The raw bytes of a [rows, cols] tensor of type `qtype` as an Int4Weight,
    or None when the type has no exact int4 map or Kiln's layout does not take the shape."""
    if qtype not in EXACT_INT4_TYPES or not layout_fits(cols, GROUP):
        return None
    q, scale, minimum = int4_parts(raw, qtype, rows, cols)
    weight = int4_weight(q, scale, minimum, GROUP, f"GGUF {qtype.name}")
    return weight if isinstance(weight, Int4Weight) else None


def int4_parts(
    raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, cols], scale float32 [rows, cols/32], min float32 [rows, cols/32])."""
    per_block, nbytes = _BLOCK_WEIGHTS[qtype], _BLOCK_BYTES[qtype]
    if cols % per_block or raw.size != rows * cols // per_block * nbytes:
        raise ValueError(f"not a {qtype.name} tensor of shape [{rows}, {cols}]")
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // per_block, nbytes)
    if qtype == GGMLQuantizationType.Q4_K:
        return _q4_k(blocks, rows, cols)
    d = _fp16(blocks[..., 0:2])
    if qtype == GGMLQuantizationType.Q4_0:
        minimum, codes = -8.0 * d, blocks[..., 2:]
    else:
        minimum, codes = _fp16(blocks[..., 2:4]), blocks[..., 4:]
    q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).reshape(rows, cols)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(minimum)


def _q4_k(blocks: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sc, m = q4_k_scale_min(blocks[..., 4:16])  # [rows, blocks, 8] each
    codes = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # [row, block, chunk, -, byte]
    q = np.concatenate([codes & 0x0F, codes >> 4], axis=3).reshape(rows, cols)  # sub-block 2c, then 2c + 1
    scale = (d[..., None] * sc.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin[..., None] * m.astype(np.float32)).reshape(rows, -1)
    return torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(minimum)


def q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> the 8 sub-blocks' 6-bit (sc, m) (ggml's get_scale_min_k4):
    sub-blocks 0-3 take the low 6 bits of bytes 0-3 (sc) and 4-7 (m);
    4-7 take a nibble of bytes 8-11 plus the top 2 bits of bytes 0-3 (sc) and 4-7 (m)."""
    lo, hi, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, m


def _fp16(two_bytes: np.ndarray) -> np.ndarray:
    return two_bytes.copy().view(np.float16)[..., 0].astype(np.float32)
