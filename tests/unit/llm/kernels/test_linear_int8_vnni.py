"""The AVX512_VNNI int8 kernel (`linear_w8a8`, the avx512_vnni and avx512_bf16
builds' `linear_w8`): activations quantized to int8 in groups of 32 along K, exact
integer dot products, fp32 scaling. Reference: the same quantization in
torch (round half to even of x * 127 / max|group|), then float64 math; only
the fp32 scaling and summation of the groups separate them (relative 1e-6).
"""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.kernels import ops
from kiln.llm.quant.int8 import quantize_int8

pytestmark = pytest.mark.skipif(not ops.vnni_int8(),
                                reason="needs a VNNI build (avx512_vnni or avx512_bf16: an AVX512_VNNI CPU)")

GROUP = 32


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 codes times their group's scale, float64."""
    rows, k = x.shape
    padded = F.pad(x, (0, -k % GROUP)).view(rows, -1, GROUP)
    amax = padded.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return (torch.round(padded * inv).double() * scale.double()).view(rows, -1)[:, :k]


# K: whole 64-wide runs, a half run (one group), tails inside a group and past one.
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("in_features", [13, 32, 48, 100, 576, 1540])
def test_matches_the_quantized_reference(rows, in_features):
    g = torch.Generator().manual_seed(rows * 100 + in_features)
    x = torch.randn(rows, in_features, generator=g) * 4
    if rows > 1:
        x[0, : min(GROUP, in_features)] = 0  # an all-zero group
    q, scales = quantize_int8(torch.randn(301, in_features, generator=g))
    y = torch.ops.kiln.linear_w8a8(x, q, scales)
    ref = F.linear(quantized_activations(x), q.double() * scales.double()[:, None])
    assert y.dtype == torch.float32 and y.shape == (rows, 301)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    exact = F.linear(x.double(), q.double() * scales.double()[:, None])
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 0.03  # int8 activations: ~1% off


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_independent_of_the_others(threads):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 1540, generator=g)
    q, scales = quantize_int8(torch.randn(500, 1540, generator=g))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = torch.ops.kiln.linear_w8a8(x, q, scales)
        for rows in (1, 2, 5, 8, 9, 40):
            for i in (0, rows - 1):
                assert torch.equal(torch.ops.kiln.linear_w8a8(x[:rows], q, scales)[i], full[i])
    finally:
        torch.set_num_threads(before)


def test_the_int8_layer_takes_it():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 576, generator=g)
    q, scales = quantize_int8(torch.randn(64, 576, generator=g))
    assert torch.equal(ops.linear_w8(x, q, scales), torch.ops.kiln.linear_w8a8(x, q, scales))
    assert not torch.equal(ops.linear_w8(x, q, scales), torch.ops.kiln.linear_w8_fp32x(x, q, scales))
