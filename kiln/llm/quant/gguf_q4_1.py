"""GGUF Q4_1 blocks -> int4 group codes, without a float round trip.

Q4_1 stores each run of 32 weights of a row as fp16 d, fp16 m and 16 bytes
of 4-bit codes (byte j: element j in the low nibble, element j+16 in the
high one), meaning w = q * d + m. That is exactly the asymmetric int4 group
format of int4.py with group_size 32: scale = d, zero = m + 8 * d, because
(q - 8) * d + (m + 8 * d) = q * d + m. Computed in float32 the two agree bit
for bit whenever m + 8 * d is exact in float32 (d * q and 8 * d are exact
for fp16 d; checked on SmolLM2's tensors in the tests).

Q8_0 (per-32 symmetric int8, fp16 scale per block) has no such map onto
int8.py's one-scale-per-output-row format; it would need a group-wise int8
kernel, which torch does not ship.

Not wired into the loader yet: the engine still dequantizes the GGUF to
float32 and quantizes again (for Q4_1 sources this recovers the same grid
only where a group uses both code 0 and code 15).
"""
from __future__ import annotations

import numpy as np
import torch

GROUP = 32
BLOCK_BYTES = 2 + 2 + GROUP // 2


def q4_1_to_int4(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw Q4_1 bytes of a [rows, cols] tensor -> (q int32 [rows, cols],
    scales float32 [cols/32, rows], zeros float32 [cols/32, rows])."""
    if cols % GROUP or raw.size != rows * cols // GROUP * BLOCK_BYTES:
        raise ValueError(f"not a Q4_1 tensor of shape [{rows}, {cols}]")
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32).reshape(rows, cols)
    scales = torch.from_numpy(d).t().contiguous()
    zeros = torch.from_numpy(m).t() + 8.0 * scales
    return torch.from_numpy(q), scales, zeros.contiguous()
