"""Kiln's fp32 CPU linear kernel against F.linear, and its row independence.

Tolerance: fp32 dot products of length K summed in a different order than
BLAS; |error| <= 1e-5 * sqrt(K) * max|x| * max|w| * a small factor.
"""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.kernels import ops, tuning
from kiln.llm.kernels.build import cpu_supported
from kiln.llm.layers.linear import Linear

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")


def test_library_is_built_and_loads():
    # `make` builds it; a missing library here means the install step failed.
    assert ops.kernels_loaded()


# 1-8 rows take the narrow micro-kernel, more the 4x3 one (with 1-3 row and
# 1-2 column remainders: 9, 17, 130 rows against 301 weight rows).
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 130, tuning.LINEAR_MAX_ROWS])
@pytest.mark.parametrize("in_features", [13, 576, 1536])
def test_matches_f_linear(rows, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(301, in_features, generator=g)
    y = ops.linear_f32(x, w)
    assert y is not None and y.shape == (rows, 301)
    torch.testing.assert_close(y, F.linear(x, w), rtol=0, atol=2e-6 * in_features**0.5 * 16)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_independent_of_the_others(threads):
    # Batch invariance relies on this: a row's result must not change with M,
    # with the micro-kernel that M selects, or with the thread count.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tuning.LINEAR_MAX_ROWS, 1540, generator=g)  # K tail of 4: the scalar tail path too
    w = torch.randn(500, 1540, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = ops.linear_f32(x, w)
        for rows in (1, 5, 8, 9, 40):
            for i in (0, rows - 1):
                assert torch.equal(ops.linear_f32(x[:rows], w)[i], full[i])
        assert torch.equal(ops.linear_f32(x[-1:], w), full[-1:])
    finally:
        torch.set_num_threads(before)


def test_falls_back_where_it_does_not_apply():
    w = torch.randn(10, 16)
    assert ops.linear_f32(torch.randn(tuning.LINEAR_MAX_ROWS + 1, 16), w) is None
    assert ops.linear_f32(torch.randn(2, 16, dtype=torch.float64), w.double()) is None
    assert ops.linear_f32(torch.randn(2, 16), w.t().contiguous().t()) is None  # non-contiguous weight
    layer = Linear(16, 10)
    layer.weight.data.copy_(w)
    x = torch.randn(tuning.LINEAR_MAX_ROWS + 5, 16)
    torch.testing.assert_close(layer(x), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 5, 9, 200])
def test_int8_weights_match_f_linear_on_the_dequantized_weight(rows):
    # The weight-only kernel (ops.linear_w8 in the avx2 build, linear_w8_fp32x
    # in every build) keeps activations in fp32: the reference is exact fp32
    # math on q * scale, so only summation order separates them.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1540, generator=g)
    q = torch.randint(-127, 128, (301, 1540), generator=g, dtype=torch.int8)
    scales = torch.rand(301, generator=g) / 100
    assert ops.kernels_loaded()
    y = torch.ops.kiln.linear_w8_fp32x(x, q, scales)
    ref = F.linear(x.double(), q.double() * scales.double()[:, None]).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(torch.ops.kiln.linear_w8_fp32x(x[-1:], q, scales), y[-1:])  # row independence
    if not ops.vnni_int8():
        assert torch.equal(ops.linear_w8(x, q, scales), y)
    assert ops.linear_w8(x, q.float(), scales) is None  # not int8: not this kernel


@pytest.mark.skipif(ops.pack_linear_weight(torch.zeros(2, 2)) is None, reason="torch built without oneDNN")
@pytest.mark.parametrize("threads", [1, 2])
def test_onednn_packed_weight_rows_are_independent_and_match_f_linear(threads):
    # Prefill-sized inputs take oneDNN with a packed weight; batch invariance
    # needs each row's result to be the same whatever M is.
    g = torch.Generator().manual_seed(5)
    w = torch.randn(960, 576, generator=g)
    x = torch.randn(300, 576, generator=g)
    packed = ops.pack_linear_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = ops.linear_packed(x, packed)
        torch.testing.assert_close(full, F.linear(x, w), rtol=0, atol=2e-6 * 576**0.5 * 16)
        for rows in (1, 7, 33, 64, 299):
            assert torch.equal(ops.linear_packed(x[:rows], packed), full[:rows])
    finally:
        torch.set_num_threads(before)


def test_layer_uses_the_packed_copy_only_for_prefill_sized_fp32_inputs(monkeypatch):
    from kiln.llm.layers import linear as linear_mod

    layer = Linear(64, 48)
    layer.weight.data.normal_()
    assert linear_mod.pack_for_prefill(layer) == (1 if ops.pack_linear_weight(layer.weight) is not None else 0)
    calls = []
    monkeypatch.setattr(linear_mod, "linear_copy", lambda x, p: calls.append(x.shape[0]) or F.linear(x, layer.weight))
    layer.packed = layer.packed if layer.packed is not None else layer.weight  # exercise routing without oneDNN too
    for rows in (1, tuning.PACKED_MIN_ROWS, tuning.PACKED_MIN_ROWS + 1, 500):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    assert calls == [tuning.PACKED_MIN_ROWS + 1, 500]
    layer.double()  # another dtype: the packed fp32 copy is not used
    x = torch.randn(100, 64, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert calls == [tuning.PACKED_MIN_ROWS + 1, 500]


def test_finished_model_takes_many_logit_rows_through_the_packed_lm_head(tiny_llama3_dir, monkeypatch):
    from kiln.config import EngineConfig
    from kiln.llm.engine.builder import build_model
    from kiln.llm.layers import linear as linear_mod
    from kiln.llm.models.loader import load_checkpoint

    config = EngineConfig.from_flat(model=str(tiny_llama3_dir), dtype="float32")
    model = build_model(load_checkpoint(tiny_llama3_dir), config, 512)
    if ops.pack_linear_weight(model.lm_head) is None:
        pytest.skip("oneDNN unavailable: no packed copy to route to")
    assert model.lm_head_packed is not None and model.lm_head is model.embed_tokens  # tied: packed, not re-pointed
    calls = []
    real = linear_mod.linear_copy
    monkeypatch.setattr(linear_mod, "linear_copy", lambda x, p: calls.append(x.shape[0]) or real(x, p))
    for rows in (1, tuning.PACKED_MIN_ROWS, tuning.PACKED_MIN_ROWS + 8):
        hidden = torch.randn(rows, model.arch.hidden_size)
        torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.lm_head), rtol=1e-5, atol=1e-4)
    assert calls == [tuning.PACKED_MIN_ROWS + 8]
