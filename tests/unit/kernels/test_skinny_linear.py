"""The skinny CPU linear kernel against F.linear, and its row independence.

Tolerance: fp32 dot products of length K summed in a different order than
BLAS; |error| <= 1e-5 * sqrt(K) * max|x| * max|w| * a small factor.
"""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported
from kiln.llm.layers.linear import Linear

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")


def test_library_is_built_and_loads():
    # `make` builds it; a missing library here means the install step failed.
    assert ops.kernels_loaded()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, ops.SKINNY_MAX_ROWS])
@pytest.mark.parametrize("in_features", [13, 576, 1536])
def test_matches_f_linear(rows, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(300, in_features, generator=g)
    y = ops.skinny_linear(x, w)
    assert y is not None and y.shape == (rows, 300)
    torch.testing.assert_close(y, F.linear(x, w), rtol=0, atol=2e-6 * in_features**0.5 * 16)


def test_each_row_is_independent_of_the_others():
    # Batch invariance relies on this: a row's result must not change with M.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 576, generator=g)
    w = torch.randn(500, 576, generator=g)
    full = ops.skinny_linear(x, w)
    for i in (0, 7, 8, 39):
        assert torch.equal(ops.skinny_linear(x[i : i + 1], w), full[i : i + 1])


def test_falls_back_where_it_does_not_apply():
    w = torch.randn(10, 16)
    assert ops.skinny_linear(torch.randn(ops.SKINNY_MAX_ROWS + 1, 16), w) is None
    assert ops.skinny_linear(torch.randn(2, 16, dtype=torch.float64), w.double()) is None
    assert ops.skinny_linear(torch.randn(2, 16), w.t().contiguous().t()) is None  # non-contiguous weight
    layer = Linear(16, 10)
    layer.weight.data.copy_(w)
    x = torch.randn(ops.SKINNY_MAX_ROWS + 5, 16)
    torch.testing.assert_close(layer(x), F.linear(x, w))
