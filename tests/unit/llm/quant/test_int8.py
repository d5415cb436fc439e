"""int8 per-channel weights: round-trip error bound and the kernel path
against F.linear with the dequantized weight."""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.quant.int8 import Int8Linear, dequantize_int8, quantize_int8


def weight(n=96, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] *= 20  # rows of very different ranges: each gets its own scale
    w[5] = 0.0  # an all-zero row must not divide by zero
    return w


def test_round_trip_within_half_a_step_per_channel():
    w = weight()
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (w.shape[0],)
    err = (dequantize_int8(q, scales) - w).abs()
    bound = scales[:, None] / 2 * (1 + 1e-5) + 1e-12
    assert (err <= bound).all()
    assert torch.equal(dequantize_int8(q, scales)[5], torch.zeros(w.shape[1]))
    # each row's largest weight is hit exactly (symmetric, max maps to +-127)
    assert (q.abs().amax(dim=1)[torch.arange(w.shape[0]) != 5] == 127).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernel_matches_float_linear_on_dequantized_weight(dtype, rows):
    w = weight()
    layer = Int8Linear.from_float(w).to(dtype)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    # The CPU kernel computes in bfloat16 (base.py): the reference uses the
    # same rounded activations and scales, so what is left is the kernel's
    # float accumulation and the bfloat16 rounding of its output.
    ref = F.linear(x.to(torch.bfloat16).float(), layer.dequantized_weight())
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, w.shape[0])
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_leading_dims_and_dtype_cast_keep_the_kernel_scales():
    layer = Int8Linear.from_float(weight())
    kernel = layer.scales.dtype
    layer.to(torch.float32)
    assert layer.scales.dtype == kernel
    x = torch.randn(2, 3, 64)
    assert layer(x).shape == (2, 3, 96)


def test_a_cast_to_bf16_keeps_the_fp32_kernel_scales_exact():
    """A bf16 model's int8 layers keep their float32 scales as computed (a cast to
    bf16 and back would round them to 8 bits of mantissa)."""
    layer = Int8Linear.from_float(weight())
    scales_f32 = layer.scales_f32.clone()
    layer.to(torch.bfloat16)
    assert layer.scales_f32.dtype == torch.float32 and torch.equal(layer.scales_f32, scales_f32)
    assert not torch.equal(scales_f32.bfloat16().float(), scales_f32)  # the rounding it would have been
