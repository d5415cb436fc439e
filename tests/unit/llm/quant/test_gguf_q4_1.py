"""Q4_1 blocks map onto the int4 group format bit-exactly: the codes and
(scale, zero) read straight from the GGUF bytes dequantize to the very
float32 values the gguf package's dequantizer produces."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kiln.llm.models.gguf_loader import open_gguf
from kiln.llm.quant.gguf_q4_1 import q4_1_to_int4
from kiln.llm.quant.int4 import dequantize_int4


def test_synthetic_blocks_round_trip():
    rng = np.random.default_rng(0)
    rows, cols = 4, 64
    blocks = np.zeros((rows, cols // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.001, 0.1, (rows, cols // 32)).astype(np.float16)
    m = rng.uniform(-1, 0, (rows, cols // 32)).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[..., 2:4] = m[..., None].view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[..., 4:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    raw = blocks.reshape(rows, -1)
    q, scales, zeros = q4_1_to_int4(raw, rows, cols)
    ref = dequantize(raw, GGMLQuantizationType.Q4_1)
    assert torch.equal(dequantize_int4(q, scales, zeros, 32), torch.from_numpy(ref))


@pytest.mark.slow
def test_smollm2_q4_1_tensors_are_bit_exact(smollm2_path):
    reader = open_gguf(smollm2_path)
    tensors = [t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q4_1][:14]  # two layers
    assert tensors
    for t in tensors:
        ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        rows, cols = ref.shape
        q, scales, zeros = q4_1_to_int4(t.data, rows, cols)
        assert torch.equal(dequantize_int4(q, scales, zeros, 32), ref), t.name
