"""int4 in Kiln's CPU kernel format: the packed layout,
the quantization error bound with fp16 parameters, the fp32-activation
kernel against fp64 F.linear on the dequantized weight, row independence,
and the fallback. (The int8-activation kernel linear_w4a8:
tests/unit/llm/kernels/test_linear_w4a8.py.)"""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported
from kiln.llm.quant import int4_cpu
from kiln.llm.quant.int4_cpu import Int4CpuLinear, pack_codes, quantize_int4_fp16, unpack_codes
from kiln.llm.quant.int8_activations import use_int8_activations

needs_kernels = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")


def weight(n=301, k=1536, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[2, :32] += 0.3  # an offset group
    w[7, 32:64] = 0.01  # a constant group
    return w


def test_pack_puts_eight_weights_per_word_one_nibble_per_step():
    q = torch.randint(0, 16, (2, 128), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    codes = pack_codes(q)
    assert codes.shape == (2, 64) and codes.dtype == torch.uint8
    words = codes.numpy().view("<u4").reshape(2, 2, 8)  # [row, run of 64, word j]
    for s in range(8):
        for j in range(8):
            assert (words[1, 1, j] >> (4 * s)) & 0xF == q[1, 64 + 8 * s + j]
    assert torch.equal(unpack_codes(codes), q)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_trip_within_half_a_step_plus_fp16_rounding(group_size):
    w = weight(96, 256)
    q, scale_min = quantize_int4_fp16(w, group_size)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and scale_min.dtype == torch.float16
    layer = Int4CpuLinear(pack_codes(q), scale_min, group_size)
    err = (layer.dequantized_weight() - w).abs().reshape(96, 256 // group_size, group_size)
    step = scale_min[..., 0].float()[..., None]
    low = scale_min[..., 1].float().abs()[..., None]
    assert (err <= step / 2 * (1 + 1e-3) + low * 2**-11 + 1e-6).all()


def fp32x(x, layer):
    """The fp32-activation kernel by its explicit name (linear_w4 runs it; linear_w4a8:
    tests/unit/llm/kernels/test_linear_w4a8.py)."""
    assert ops.kernels_loaded()  # registers torch.ops.kiln.*
    return torch.ops.kiln.linear_w4_fp32x(x, layer.codes, layer.scale_min, layer.group_size)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 9, 200])
@pytest.mark.parametrize("group_size", [32, 96, 128])
def test_fp32x_kernel_matches_f_linear_on_the_dequantized_weight(rows, group_size):
    # Activations stay fp32 and the weights dequantize exactly as
    # dequantized_weight() says (up to one rounding of q * scale + min), so
    # only summation order separates the kernel from fp64 math. (G = 96: a
    # run's second half starts the next group.)
    layer = Int4CpuLinear.from_float(weight(), group_size)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    y = fp32x(x, layer)
    ref = F.linear(x.double(), layer.dequantized_weight().double()).float()
    assert y.shape == (rows, 301)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if rows <= int4_cpu.INT4_DEQUANT_MIN_ROWS:  # above: the widened weight (next tests)
        torch.testing.assert_close(layer(x), y, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("group_size", [32, 128])
def test_fp32_parameters_compute_what_fp16_ones_do_and_their_own_values(group_size):
    # The same values as fp32: bit-identical results (same arithmetic per weight), in both kernels.
    layer = Int4CpuLinear.from_float(weight(), group_size)
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(7))
    fp32 = Int4CpuLinear(layer.codes, layer.scale_min.float(), group_size)
    assert torch.equal(fp32(x), layer(x))
    assert torch.equal(fp32x(x, fp32), fp32x(x, layer))
    # Values fp16 cannot hold: the kernel uses them, not a rounded copy.
    sm = layer.scale_min.float() * (1 + 2**-15)
    exact = Int4CpuLinear(layer.codes, sm, group_size)
    assert not torch.equal(sm.half().float(), sm)
    ref = F.linear(x.double(), exact.dequantized_weight().double()).float()
    torch.testing.assert_close(fp32x(x, exact), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert not torch.equal(fp32x(x, exact), fp32x(x, layer))
    assert not torch.equal(exact(x), layer(x))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group_size", [64, 96])
@pytest.mark.parametrize("k", [1536, 1152, 576])
def test_each_row_is_independent_of_the_others(threads, group_size, k):
    # Up to 8 rows the kernel widens in registers; above, a tile of weight rows into a buffer
    # that every row reads, in K blocks of 512 where K > 1024 (1152: a short last block): the
    # same bits either way.
    layer = Int4CpuLinear.from_float(weight(k=k), group_size)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        for rows in (1, 5, 8, 9, 13):
            assert torch.equal(layer(x[:rows]), full[:rows])
        assert torch.equal(layer(x[-1:]), full[-1:])
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_kernel_rejects_what_it_does_not_take():
    layer = Int4CpuLinear.from_float(weight(8, 64), 32)
    x = torch.randn(2, 64)
    assert ops.linear_w4(x.double(), layer.codes, layer.scale_min, 32) is None
    assert ops.linear_w4(x, layer.codes, layer.scale_min.double(), 32) is None
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.kiln.linear_w4(x, layer.codes, layer.scale_min, 48)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        torch.ops.kiln.linear_w4(torch.randn(2, 32), layer.codes, layer.scale_min, 32)
    assert not int4_cpu.int4_cpu_supported(torch.randn(8, 96), 32)  # K not a multiple of 64


def test_bf16_activations_and_the_fallback_agree(monkeypatch):
    layer = Int4CpuLinear.from_float(weight(16, 128), 32)
    x = torch.randn(3, 128)
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (3, 16)
    monkeypatch.setattr(int4_cpu, "linear_w4", lambda *a: None)  # library absent
    ref = F.linear(x, layer.dequantized_weight())
    torch.testing.assert_close(layer(x), ref)
    bf16_ref = F.linear(x.bfloat16().float(), layer.dequantized_weight())
    torch.testing.assert_close(out.float(), bf16_ref, rtol=1e-2, atol=1e-2)


def linear_bf16_in_run_order(x, w):
    """linear_bf16 with K taken in the order the int4 codes lie in, as
    kiln::linear_w4_bf16 widens them: in each run of 64 weights (eight 32-bit
    words, weight 8s + j in nibble s of word j), position p of the first 32 is
    weight 16 (p % 4) + p // 4 (the low nibbles of the run's bytes), of the
    second 32 that plus 8 (the high nibbles). Same products, that summation order."""
    run = [16 * (p % 4) + 8 * half + p // 4 for half in (0, 1) for p in range(32)]
    order = torch.tensor([start + i for start in range(0, x.shape[1], 64) for i in run])
    assert sorted(order.tolist()) == list(range(x.shape[1]))
    return torch.ops.kiln.linear_bf16(x[:, order].contiguous(), w[:, order].contiguous())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 37, int4_cpu.INT4_BF16_DEQUANT_MIN_ROWS + 3])
def test_in_a_bf16_model_every_row_count_runs_bf16_dot_products_on_the_weight_widened_to_bf16(rows):
    """On a CPU with bf16 dot products a bf16 model's kept int4 projection is the
    model in bf16 (its weights rounded to bf16, as its activations are) at every
    row count: Kiln's bf16 kernel up to INT4_BF16_DEQUANT_MIN_ROWS rows (the
    weights widened in registers up to 8, by tiles above: one chain, so a
    decode row, a prompt's cached tail and a batch give a row the same bits)
    and oneDNN's bf16 GEMM above; elsewhere the fp32 kernel on the stored
    weights, rounded once. The cast leaves codes and fp16 scale/min alone."""
    layer = Int4CpuLinear.from_float(weight(), 64)
    codes, scale_min = layer.codes.clone(), layer.scale_min.clone()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.codes, codes) and torch.equal(layer.scale_min, scale_min)
    assert layer.scale_min.dtype == torch.float16
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    if ops.bf16_dot_products():
        widened = ops.dequantize_w4(layer.codes, layer.scale_min, 64, torch.bfloat16)
        assert widened is not None and torch.equal(widened, layer.dequantized_weight().bfloat16())
        if rows <= int4_cpu.INT4_BF16_DEQUANT_MIN_ROWS:
            assert torch.equal(y, linear_bf16_in_run_order(x, widened))
            for part in (slice(0, 1), slice(rows // 2, rows)):
                assert torch.equal(layer(x[part]), y[part])
        else:
            assert torch.equal(y, F.linear(x, widened))
    else:
        assert torch.equal(y, ops.linear_w4(x.float(), layer.codes, layer.scale_min, 64).bfloat16())
    ref = F.linear(x.double(), layer.dequantized_weight().double())
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


needs_bf16_dots = pytest.mark.skipif(not ops.bf16_dot_products(), reason="no AVX512_BF16 kernel build loaded")


@needs_bf16_dots
@pytest.mark.parametrize("params", [torch.float16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_linear_w4_bf16_is_linear_bf16_on_the_widened_weight_in_run_order_row_independently(params, group_size):
    layer = Int4CpuLinear.from_float(weight(301, 1536), group_size)
    scale_min = layer.scale_min.to(params)
    widened = ops.dequantize_w4(layer.codes, scale_min, group_size, torch.bfloat16)
    x = torch.randn(67, 1536, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = ops.linear_w4_bf16(x, layer.codes, scale_min, group_size)
    assert y is not None and y.dtype == torch.bfloat16
    assert torch.equal(y, linear_bf16_in_run_order(x, widened))
    for rows in (slice(0, 1), slice(3, 8), slice(5, 14), slice(60, 67)):
        assert torch.equal(ops.linear_w4_bf16(x[rows], layer.codes, scale_min, group_size), y[rows])


@needs_bf16_dots
def test_linear_w4_bf16_refuses_operands_it_cannot_take():
    layer = Int4CpuLinear.from_float(weight(40, 256), 32)
    x = torch.randn(3, 256).bfloat16()
    assert ops.linear_w4_bf16(x.float(), layer.codes, layer.scale_min, 32) is None  # fp32 x: the fp32 kernel's
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.kiln.linear_w4_bf16(x, layer.codes, layer.scale_min, 48)
    with pytest.raises(RuntimeError, match="bf16 CPU x"):
        torch.ops.kiln.linear_w4_bf16(torch.randn(3, 128).bfloat16(), layer.codes, layer.scale_min, 32)
    with pytest.raises(RuntimeError, match="scale_min"):
        torch.ops.kiln.linear_w4_bf16(x, layer.codes, layer.scale_min[:, :1], 32)


@needs_kernels
@pytest.mark.parametrize("params", [torch.float16, torch.float32])
def test_the_weight_widened_to_bf16_is_the_fp32_one_rounded_to_nearest_even(params):
    # scale 2^-8 and min 1: odd codes land exactly halfway between bf16 neighbours (spacing 2^-7 at 1.0).
    q = torch.arange(16, dtype=torch.int32).repeat(4, 8)  # [4, 128]
    scale_min = torch.tensor([2.0 ** -8, 1.0]).repeat(4, 4, 1).to(params)  # groups of 32
    scale_min[1] = torch.tensor([-(2.0 ** -8), -1.0]).to(params)  # and negative ties
    scale_min[2] = torch.tensor([3.0, -7.0]).to(params)
    codes = pack_codes(q)
    fp32 = ops.dequantize_w4(codes, scale_min, 32)
    bf16 = ops.dequantize_w4(codes, scale_min, 32, torch.bfloat16)
    assert fp32 is not None and bf16 is not None and bf16.dtype == torch.bfloat16
    assert fp32[0, 1].item() == 1.0 + 2.0 ** -8 and bf16[0, 1].item() == 1.0  # a tie goes to the even neighbour
    assert bf16[0, 3].item() == 1.0 + 2.0 ** -6
    assert torch.equal(bf16, fp32.to(torch.bfloat16))
    layer = Int4CpuLinear.from_float(weight(96, 256), 32)
    sm = layer.scale_min.to(params)
    assert torch.equal(ops.dequantize_w4(layer.codes, sm, 32, torch.bfloat16),
                       ops.dequantize_w4(layer.codes, sm, 32).to(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("params", [torch.float16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_widened_weight_is_the_one_the_kernel_multiplies_by(params, group_size):
    layer = Int4CpuLinear.from_float(weight(40, 256), group_size)
    scale_min = layer.scale_min.to(params)
    widened = ops.dequantize_w4(layer.codes, scale_min, group_size)
    # x = I: every output is one weight times 1 plus zeros, exact whatever the order.
    through_kernel = ops.linear_w4(torch.eye(256), layer.codes, scale_min, group_size)
    assert widened is not None and through_kernel is not None and torch.equal(widened, through_kernel.T)
    torch.testing.assert_close(widened, layer.dequantized_weight(), rtol=0, atol=1e-7)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.kiln.dequantize_w4(layer.codes, scale_min, 48)


@needs_kernels
def test_prefill_sized_inputs_take_the_panels_above_the_limit(monkeypatch):
    layer = Int4CpuLinear.from_float(weight(), 64)
    rows = int4_cpu.INT4_DEQUANT_MIN_ROWS + 40
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(1))
    calls = []
    real = int4_cpu.linear_w4_panels
    monkeypatch.setattr(int4_cpu, "linear_w4_panels", lambda a, *rest: calls.append(a.shape[0]) or real(a, *rest))
    y = layer(x)
    ref = F.linear(x.double(), layer.dequantized_weight().double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(layer(x[: rows - 7]), y[: rows - 7])  # a row's result does not depend on the others
    assert calls == [rows, rows - 7]
    layer(x[: int4_cpu.INT4_DEQUANT_MIN_ROWS])
    assert calls == [rows, rows - 7]  # up to the limit: the int4 kernel


@needs_kernels
def test_int8_activations_switch_fp32_inputs_to_linear_w4a8():
    layer = Int4CpuLinear.from_float(weight(40, 256), 32)
    x = torch.randn(20, 256)
    exact = layer(x)
    assert use_int8_activations(torch.nn.Sequential(layer, torch.nn.Linear(4, 4))) == 1
    a8 = layer(x)
    assert torch.equal(a8, ops.linear_w4a8(x, layer.codes, layer.scale_min, 32)) and not torch.equal(a8, exact)
    assert (a8 - exact).abs().max() < 0.02 * exact.abs().max()  # groups of 32 quantized to 8 bits
    # bf16 activations are not what the switch is for: their paths stay as they were.
    layer.int8_activations = False
    bf16_exact = layer(x[:4].bfloat16())
    layer.int8_activations = True
    assert torch.equal(layer(x[:4].bfloat16()), bf16_exact)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("params", ["fp16", "fp32"])
def test_prompt_sized_inputs_take_the_panels_row_independently(threads, params):
    # Above INT4_DEQUANT_MIN_ROWS rows: kiln::linear_w4_panels, one fp32 chain
    # along K per output. 301 weight rows: a last panel of 13 (45 in the avx512
    # build's panels of 64); 1536 inputs: six K blocks (one in the avx512
    # build); 487 x rows: two row blocks of 240 and a tail of 7 (the six-row
    # micro-kernel's padded pass).
    layer = Int4CpuLinear.from_float(weight(), 64)
    if params == "fp32":
        layer = Int4CpuLinear(layer.codes, layer.scale_min.float(), 64)
    x = torch.randn(487, 1536, generator=torch.Generator().manual_seed(11))
    ref = F.linear(x.double(), layer.dequantized_weight().double()).float()
    panels = ops.linear_w4_panels
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert torch.equal(full, panels(x, layer.codes, layer.scale_min, 64))
        # A row's bits wherever it sits and whatever M is.
        for rows in (int4_cpu.INT4_DEQUANT_MIN_ROWS + 1, 240, 241, 300):
            assert torch.equal(layer(x[:rows]), full[:rows])
        for lo, hi in ((480, 487), (5, 6), (100, 113)):
            assert torch.equal(panels(x[lo:hi], layer.codes, layer.scale_min, 64), full[lo:hi])
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(full[:9], layer(x[:9]))  # up to the limit, the int4 kernel's other chain
    assert panels(x.double(), layer.codes, layer.scale_min, 64) is None
