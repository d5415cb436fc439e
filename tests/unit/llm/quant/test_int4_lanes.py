"""int4 in lane layout (a bf16 model's int4 projections on CPUs with bf16 dot
products): the layout bit by bit, the kernel against fp64 on the dequantized
weight, a row's bits whatever the batch, the fallback, the swap in a
finished model, and the packed bf16 copy for steps of many rows
(`--int4-prefill-weights`)."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig
from kiln.errors import ConfigError
from kiln.llm.kernels import ops
from kiln.llm.kernels.tuning import INT4_LANES_PACKED_MIN_ROWS
from kiln.llm.quant import int4_lanes
from kiln.llm.quant.int4_cpu import Int4CpuLinear, pack_codes, quantize_int4_fp16, unpack_codes
from kiln.llm.quant.int4_lanes import (
    Int4LaneLinear,
    from_lanes,
    keep_prefill_copies,
    lay_out_lanes,
    to_lanes,
)

needs_bf16_kernel = pytest.mark.skipif(
    not ops.bf16_dot_products(), reason="no bf16 dot products in the loaded kernel build (no AVX512_BF16)"
)


def int4_layer(n, k, group_size, seed=0, params_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, :group_size] += 0.3  # an offset group
    q, scale_min = quantize_int4_fp16(w, group_size)
    return Int4CpuLinear(pack_codes(q), scale_min.to(params_dtype), group_size)


def test_lane_words_hold_pairs_of_a_rows_weights():
    q = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    scale_min = torch.randn(32, 2, 2).half()
    lanes, params = to_lanes(q, scale_min, 32)
    assert lanes.shape == (2, 8, 16) and lanes.dtype == torch.int32 and params.shape == (2, 2, 2, 16)
    word = int(lanes[1, 5, 9]) & 0xFFFFFFFF  # row 16 + 9, weights 40..47
    for p in range(4):
        assert (word >> (4 * p)) & 0xF == q[25, 40 + 2 * p]
        assert (word >> (16 + 4 * p)) & 0xF == q[25, 41 + 2 * p]
    assert torch.equal(params[1, 1, :, 9], scale_min[25, 1])
    back_q, back_sm = from_lanes(lanes, params)
    assert torch.equal(back_q, q) and torch.equal(back_sm, scale_min)


def test_dequantized_weight_is_the_int4_layers():
    layer = int4_layer(48, 192, 64)
    assert torch.equal(Int4LaneLinear.from_int4_cpu(layer).dequantized_weight(), layer.dequantized_weight())


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 130])
@pytest.mark.parametrize("group_size,params_dtype", [(32, torch.float16), (96, torch.float16), (64, torch.float32)])
def test_kernel_matches_fp64_on_the_unrounded_weights(rows, group_size, params_dtype):
    """Within the bf16 rounding of the output, plus what the 128 offset costs in fp32."""
    layer = Int4LaneLinear.from_int4_cpu(int4_layer(80, 576, group_size, params_dtype=params_dtype))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = ops.linear_w4l_bf16(x, layer.lanes, layer.params, group_size)
    w = layer.dequantized_weight().double()
    ref = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 80)
    assert ((y.double() - ref).abs() <= ulp + 1e-4 * magnitude + 1e-6).all()


@needs_bf16_kernel
def test_a_rows_bits_do_not_depend_on_the_batch():
    layer = Int4LaneLinear.from_int4_cpu(int4_layer(112, 1536, 32))
    x = torch.randn(150, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = layer(x)
    for start, size in [(0, 1), (5, 1), (7, 2), (10, 3), (20, 4), (31, 9), (100, 50)]:
        part = layer(x[start:start + size].clone())
        assert torch.equal(part, whole[start:start + size]), (start, size)


@needs_bf16_kernel
@pytest.mark.parametrize("next_rows", [16, 96, 112, 400, 1024])  # one thread's pass, both threads', tails
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_naming_the_next_calls_weights_changes_no_bits(rows, next_rows):
    """`next_lanes` only asks for the next call's first pass while the last one here runs (the fused
    decode passes it from projection to projection); a tensor not in lane layout is ignored."""
    layer = Int4LaneLinear.from_int4_cpu(int4_layer(208, 576, 32))
    after = Int4LaneLinear.from_int4_cpu(int4_layer(next_rows, 1536, 32, seed=1))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = torch.ops.kiln.linear_w4l_bf16(x, layer.lanes, layer.params, 32)
    for following in (after.lanes, after.params, torch.zeros(3)):
        assert torch.equal(torch.ops.kiln.linear_w4l_bf16(x, layer.lanes, layer.params, 32, following), alone)


def test_fallback_without_bf16_activations_is_f_linear_on_the_same_weights():
    layer = Int4LaneLinear.from_int4_cpu(int4_layer(32, 128, 32))
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantized_weight()), rtol=1e-5, atol=1e-5)


class TwoProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.fits = int4_layer(32, 128, 32)
        self.odd_rows = int4_layer(24, 128, 32, seed=1)  # not a multiple of 16: stays


def test_lay_out_swaps_a_bf16_models_projections_where_the_kernel_runs():
    model = TwoProjections()
    swapped = lay_out_lanes(model, torch.bfloat16)
    assert type(model.odd_rows) is Int4CpuLinear
    if not ops.bf16_dot_products():
        assert swapped == 0 and type(model.fits) is Int4CpuLinear
        return
    assert swapped == 1 and type(model.fits) is Int4LaneLinear
    assert lay_out_lanes(TwoProjections(), torch.float32) == 0  # fp32 models keep their kernels' layout


def test_unpack_of_lanes_matches_the_codes_layout():
    layer = int4_layer(16, 256, 64, seed=2)
    lanes, params = to_lanes(unpack_codes(layer.codes), layer.scale_min, 64)
    q, scale_min = from_lanes(lanes, params)
    assert torch.equal(pack_codes(q), layer.codes) and torch.equal(scale_min, layer.scale_min)


@needs_bf16_kernel
def test_the_packed_copy_takes_steps_from_the_threshold_and_the_lanes_below_it():
    layer = Int4LaneLinear.from_int4_cpu(int4_layer(64, 576, 32))
    plain = Int4LaneLinear.from_int4_cpu(int4_layer(64, 576, 32))
    assert layer.pack() >= 2 * 64 * 576 and layer.packed is not None
    rounded = ops.pack_linear_weight(layer.dequantized_weight().bfloat16())
    x = torch.randn(INT4_LANES_PACKED_MIN_ROWS + 40, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    below = x[: INT4_LANES_PACKED_MIN_ROWS - 1]
    assert torch.equal(layer(below), plain(below))  # the int4 lanes, unrounded weights
    for rows in (INT4_LANES_PACKED_MIN_ROWS, INT4_LANES_PACKED_MIN_ROWS + 40):
        y = layer(x[:rows].reshape(2, rows // 2, 576))  # leading dims kept
        assert y.shape == (2, rows // 2, 64)
        assert torch.equal(y.reshape(rows, 64), ops.linear_packed(x[:rows], rounded))
    # The rounded weights stay within the bf16 rounding of the unrounded ones' products.
    w = layer.dequantized_weight().double()
    ref, magnitude = x.double() @ w.T, x.double().abs() @ w.abs().T
    assert ((layer(x).double() - ref).abs() <= 2 * torch.finfo(torch.bfloat16).eps * magnitude + 1e-6).all()


LANE_COPY_MIN_ROWS = 16  # kLaneCopyMinRows in kiln/llm/kernels/linear_w4l_bf16.cpp


@needs_bf16_kernel
def test_a_copy_that_does_not_match_the_lanes_is_named():
    layer = Int4LaneLinear.from_int4_cpu(int4_layer(32, 64, 32))
    with pytest.raises(RuntimeError, match="the bf16 copy .* must match the lanes"):
        torch.ops.kiln.linear_w4l_bf16(torch.randn(16, 64).bfloat16(), layer.lanes, layer.params, 32, None,
                                       ops.bf16_lanes_copy(torch.randn(48, 64).bfloat16()))


@needs_bf16_kernel
def test_the_copy_in_lanes_takes_steps_from_16_rows_and_the_int4_lanes_below():
    layer = Int4LaneLinear.from_int4_cpu(int4_layer(64, 576, 32))
    plain = Int4LaneLinear.from_int4_cpu(int4_layer(64, 576, 32))
    assert layer.pack(in_lanes=True) == 2 * 64 * 576 and layer.lane_copy is not None
    rounded = ops.bf16_lanes_copy(layer.dequantized_weight().bfloat16())
    x = torch.randn(150, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    for rows in (1, 8, LANE_COPY_MIN_ROWS - 1):
        assert torch.equal(layer(x[:rows]), plain(x[:rows]))  # the int4 lanes, unrounded weights
    for rows in (LANE_COPY_MIN_ROWS, 39, INT4_LANES_PACKED_MIN_ROWS, 150):  # no oneDNN copy at 128+ rows here
        y = layer(x[:rows])
        assert torch.equal(y, ops.linear_bf16_lanes(x[:rows], rounded))
        assert torch.equal(y[:LANE_COPY_MIN_ROWS], layer(x[:LANE_COPY_MIN_ROWS]))  # a row's bits from 16 rows on
    w = layer.dequantized_weight().double()
    ref, magnitude = x.double() @ w.T, x.double().abs() @ w.abs().T
    assert ((layer(x).double() - ref).abs() <= 2 * torch.finfo(torch.bfloat16).eps * magnitude + 1e-6).all()


@needs_bf16_kernel
@pytest.mark.parametrize("amx", [True, False])
def test_the_copies_form_follows_amx(monkeypatch, amx):
    monkeypatch.setattr(int4_lanes, "copies_in_lanes", lambda: not amx)
    model = LaneProjections()
    assert keep_prefill_copies(model, "bf16", None) == NEED
    for m in (model.a, model.b):
        assert (m.lane_copy is None) is amx
        assert m.packed is not None and (m.packed.shape == (m.out_features // 16, m.in_features // 2, 16, 2)) is not amx




class LaneProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Int4LaneLinear.from_int4_cpu(int4_layer(32, 128, 32))
        self.b = Int4LaneLinear.from_int4_cpu(int4_layer(16, 64, 32, seed=1))


NEED = 2 * (32 * 128 + 16 * 64)  # bytes of both copies in bf16


@needs_bf16_kernel
@pytest.mark.parametrize(
    "choice,available,kept",
    [("int4", 1 << 40, False), ("auto", None, False), ("auto", 8 * NEED - 1, False), ("auto", 8 * NEED, True),
     ("bf16", None, True), ("bf16", 1, True)],
)
def test_copies_are_kept_as_the_option_and_the_available_memory_say(choice, available, kept):
    model = LaneProjections()
    assert (keep_prefill_copies(model, choice, available) >= NEED) is kept
    assert all((m.packed is not None) is kept for m in (model.a, model.b))


def test_bf16_copies_without_lane_projections_warn_and_keep_nothing(caplog):
    model = TwoProjections()  # Int4CpuLinear: not laid out (an fp32 model, or no AVX512_BF16)
    with caplog.at_level(logging.WARNING, logger="kiln.llm.quant.int4_lanes"):
        assert keep_prefill_copies(model, "bf16", 1 << 40) == 0
    assert "no int4 projections in lane layout" in caplog.text
    assert keep_prefill_copies(model, "auto", 1 << 40) == 0


def test_an_unknown_choice_is_a_config_error():
    with pytest.raises(ConfigError, match="int4_prefill_weights must be one of .*got 'fp8'") as err:
        ModelConfig(int4_prefill_weights="fp8")
    assert err.value.param == "int4_prefill_weights"
