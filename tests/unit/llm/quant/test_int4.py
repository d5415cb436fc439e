"""int4 group-wise weights: round-trip error bound per group and the packed
kernel against F.linear with the dequantized weight."""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.quant.int4 import Int4Linear, dequantize_int4, int4_supported, quantize_int4


def weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[2, :32] += 0.3  # an offset group: asymmetric ranges are what the zero is for
    w[7, 32:64] = 0.01  # a constant group
    return w


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_trip_within_half_a_step_per_group(group_size):
    w = weight()
    q, scales, zeros = quantize_int4(w, group_size)
    n, k = w.shape
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (k // group_size, n)
    err = (dequantize_int4(q, scales, zeros, group_size) - w).abs().reshape(n, k // group_size, group_size)
    bound = scales.t()[..., None] / 2 * (1 + 1e-4) + 1e-6
    assert (err <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("group_size", [32, 64])
def test_kernel_matches_float_linear_on_dequantized_weight(dtype, rows, group_size):
    w = weight()
    q, scales, zeros = quantize_int4(w, group_size)
    layer = Int4Linear.from_codes(q, scales, zeros, group_size, w.device, dtype)
    sz = layer.scales_and_zeros.float()  # the kernel's (bfloat16) scales and zeros
    deq = dequantize_int4(q, sz[..., 0], sz[..., 1], group_size)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = F.linear(x.to(torch.bfloat16).float(), deq)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, w.shape[0])
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_supported_shapes():
    cpu = torch.device("cpu")
    assert int4_supported(576, 960, 32, cpu)
    assert not int4_supported(576, 960, 128, cpu)  # 576 is not a multiple of 128
    assert not int4_supported(576, 962, 32, torch.device("cuda"))  # the CUDA kernel wants N % 8 == 0
