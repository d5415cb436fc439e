"""The int4 x int8-activation kernel (`linear_w4a8`; `linear_w4` keeps fp32 activations):
x quantized per row in groups of 32 along K as linear_w8a8 does, exact
integer dot products against the codes and integer sums of the quantized x
for the offset term: the weights times x as quantized. Reference: the same
quantization in torch, then float64 math; only the fp32 scaling and
summation separate them (relative ~1e-6)."""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported
from kiln.llm.quant.int4_cpu import Int4CpuLinear, unpack_codes

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")

XGROUP = 32


@pytest.fixture(autouse=True)
def library():
    assert ops.kernels_loaded()  # registers torch.ops.kiln.*


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: int8 codes times their group's scale, float64 [M, K]."""
    rows, k = x.shape
    groups = x.view(rows, k // XGROUP, XGROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return (torch.round(groups * inv).double() * scale.double()).view(rows, k)


def reference(x: torch.Tensor, layer: Int4CpuLinear) -> torch.Tensor:
    """The quantized x times the weights q * scale + min, all in float64."""
    n, k, g = layer.out_features, layer.in_features, layer.group_size
    q = unpack_codes(layer.codes).double().view(n, k // g, g)
    sm = layer.scale_min.double()
    return F.linear(quantized_activations(x), (q * sm[..., :1] + sm[..., 1:]).view(n, k))


def layer_for(n: int, k: int, group_size: int, fp32_params: bool, seed: int = 0) -> Int4CpuLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[2, :32] += 0.3  # an offset group
    layer = Int4CpuLinear.from_float(w, group_size)
    if fp32_params:  # values fp16 cannot hold: the kernel must use them as given
        return Int4CpuLinear(layer.codes, layer.scale_min.float() * (1 + 2**-15), group_size)
    return layer


def w4a8(x: torch.Tensor, layer: Int4CpuLinear) -> torch.Tensor:
    return torch.ops.kiln.linear_w4a8(x, layer.codes, layer.scale_min, layer.group_size)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("group_size", [32, 64, 96, 128])
@pytest.mark.parametrize("fp32_params", [False, True])
def test_matches_the_quantized_reference(rows, group_size, fp32_params):
    layer = layer_for(301, 1152, group_size, fp32_params)
    x = torch.randn(rows, 1152, generator=torch.Generator().manual_seed(rows)) * 4
    x[0, 64:96] = 0  # an all-zero group
    y = w4a8(x, layer)
    ref = reference(x, layer)
    assert y.dtype == torch.float32 and y.shape == (rows, 301)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    exact = F.linear(x.double(), layer.dequantized_weight().double())
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 0.03  # int8 activations: ~1% off


def test_fp16_and_fp32_parameters_of_equal_value_give_equal_bits():
    layer = layer_for(64, 576, 32, fp32_params=False)
    as_fp32 = Int4CpuLinear(layer.codes, layer.scale_min.float(), 32)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    assert torch.equal(w4a8(x, as_fp32), w4a8(x, layer))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fp32_params", [False, True])
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(threads, fp32_params):
    layer = layer_for(203, 640, 64, fp32_params)
    x = torch.randn(20, 640, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = w4a8(x, layer)
        for rows in range(1, 21):  # every narrow and wide micro-kernel shape and their mixes
            assert torch.equal(w4a8(x[:rows], layer), full[:rows]), rows
            assert torch.equal(w4a8(x[20 - rows:], layer), full[20 - rows:]), rows
        for subset in ([3], [0, 7, 19], [5, 2, 11, 13, 1, 17, 4, 8, 9]):
            assert torch.equal(w4a8(x[subset], layer), full[subset]), subset
    finally:
        torch.set_num_threads(before)


def test_ops_wrapper_runs_it_and_linear_w4_keeps_fp32_activations():
    layer = layer_for(64, 576, 32, fp32_params=False)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    y = ops.linear_w4a8(x, layer.codes, layer.scale_min, 32)
    assert y is not None and torch.equal(y, w4a8(x, layer))
    assert ops.linear_w4a8(x.double(), layer.codes, layer.scale_min, 32) is None
    fp32 = ops.linear_w4(x, layer.codes, layer.scale_min, 32)  # the default (see linear_f32.cpp)
    assert torch.equal(fp32, torch.ops.kiln.linear_w4_fp32x(x, layer.codes, layer.scale_min, 32))
    assert torch.equal(layer(x), fp32) and not torch.equal(y, fp32)


def test_rejects_what_it_does_not_take():
    layer = layer_for(8, 128, 32, fp32_params=False)
    with pytest.raises(RuntimeError, match="group_size must be .* K a multiple of 64"):
        torch.ops.kiln.linear_w4a8(torch.randn(2, 96), layer.codes[:, :48].contiguous(), layer.scale_min[:, :3], 32)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.kiln.linear_w4a8(torch.randn(2, 128), layer.codes, layer.scale_min, 48)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        torch.ops.kiln.linear_w4a8(torch.randn(2, 64), layer.codes, layer.scale_min, 32)
    with pytest.raises(RuntimeError, match="scale_min"):
        torch.ops.kiln.linear_w4a8(torch.randn(2, 128), layer.codes, layer.scale_min.double(), 32)
