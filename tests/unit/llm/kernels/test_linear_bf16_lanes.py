"""bf16 weights in lane layout (kiln::linear_bf16_lanes): the layout, the
product against fp64, a row's bits whatever the batch, the errors, and the
copies for many rows that Linear and the LM head keep in that layout on CPUs
with AVX512_BF16 and no AMX (`ops.copy_for_many_rows`)."""
import pytest
import torch

from kiln.errors import KilnError
from kiln.llm.kernels import isa, ops
from kiln.llm.layers.linear import Linear, project

needs_bf16_kernel = pytest.mark.skipif(
    not ops.bf16_dot_products(), reason="no bf16 dot products in the loaded kernel build (no AVX512_BF16)"
)


def test_the_lane_layout_holds_pairs_of_a_rows_weights():
    w = torch.randn(32, 8).bfloat16()
    lanes = ops.bf16_lanes_copy(w)
    assert lanes.shape == (2, 4, 16, 2) and lanes.dtype == torch.bfloat16
    assert torch.equal(lanes[1, 3, 5], w[16 + 5, 6:8])  # block 1, pair 3, lane 5: row 21, weights 6 and 7


@needs_bf16_kernel
@pytest.mark.parametrize("n,k", [(48, 64), (80, 576), (16, 2)])  # 80 rows: a tile of 3 blocks and 2 more
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 23, 97, 200])  # tiles of 8 and their tails; 96-row sweeps
def test_bf16_lanes_multiply_as_fp64_and_give_a_row_its_bits_whatever_the_batch(n, k, rows):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    lanes = ops.bf16_lanes_copy(w)
    y = ops.linear_bf16_lanes(x, lanes)
    ref, magnitude = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert ((y.double() - ref).abs() <= torch.finfo(torch.bfloat16).eps * magnitude + 1e-30).all()
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(y[i], ops.linear_bf16_lanes(x[i : i + 1], lanes)[0])


@needs_bf16_kernel
def test_bf16_lanes_name_the_layout_they_need():
    w, x = torch.randn(32, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"linear_bf16_lanes: bf16 CPU lanes \[N/16, K/2, 16, 2\] required"):
        torch.ops.kiln.linear_bf16_lanes(x, w)
    with pytest.raises(RuntimeError, match="linear_bf16_lanes: x has 32 columns, the weight 64"):
        torch.ops.kiln.linear_bf16_lanes(x[:, :32], ops.bf16_lanes_copy(w))
    with pytest.raises(RuntimeError, match="linear_bf16_lanes: bf16 CPU x"):
        torch.ops.kiln.linear_bf16_lanes(x.float(), ops.bf16_lanes_copy(w))


@pytest.mark.parametrize("in_lanes", [True, False])
def test_a_bf16_linear_keeps_its_copy_in_the_form_the_cpu_takes(monkeypatch, in_lanes):
    monkeypatch.setattr(ops, "copies_in_lanes", lambda: in_lanes)
    torch.manual_seed(0)
    layer = Linear(64, 48)
    layer.weight.data = torch.randn(48, 64).bfloat16()
    layer.pack()
    if in_lanes:
        assert torch.equal(layer.packed, ops.bf16_lanes_copy(layer.weight))
    elif layer.packed is not None:  # oneDNN-packed (None where oneDNN is unavailable)
        assert layer.packed.dim() == 2
    odd = Linear(64, 24)  # rows no multiple of 16: oneDNN whatever the CPU
    odd.weight.data = torch.randn(24, 64).bfloat16()
    odd.pack()
    assert odd.packed is None or odd.packed.dim() == 2
    fp32 = Linear(64, 48)
    fp32.pack()
    assert fp32.packed is None or fp32.packed.dim() == 2


@needs_bf16_kernel
def test_steps_of_more_than_8_rows_take_the_lane_copy_and_fewer_the_plain_weight(monkeypatch):
    monkeypatch.setattr(ops, "copies_in_lanes", lambda: True)
    g = torch.Generator().manual_seed(1)
    layer = Linear(576, 96)
    layer.weight.data = (torch.randn(96, 576, generator=g) * 0.05).bfloat16()
    layer.pack()
    x = torch.randn(40, 576, generator=g).bfloat16()
    assert torch.equal(layer(x), ops.linear_bf16_lanes(x, layer.packed))
    assert torch.equal(layer(x[:9]), ops.linear_bf16_lanes(x[:9], layer.packed))
    assert torch.equal(layer(x[:8]), ops.linear(x[:8], layer.weight))  # Kiln's row-major kernel, as the fused layer
    assert torch.equal(project(x, layer.weight, None), ops.linear(x, layer.weight))


def test_a_lane_copy_without_the_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ops, "linear_bf16_lanes", lambda x, lanes: None)
    with pytest.raises(KilnError, match="lane layout needs the kernel build with bf16 dot products"):
        ops.linear_copy(torch.randn(16, 64).bfloat16(), ops.bf16_lanes_copy(torch.randn(32, 64).bfloat16()))


def test_a_forced_isa_below_amx_keeps_copies_in_lanes_where_the_build_has_bf16_dot_products(monkeypatch):
    monkeypatch.setenv("KILN_ISA", "avx512_bf16")
    isa.cpu_isa.cache_clear()
    try:
        assert ops.copies_in_lanes() is ops.bf16_dot_products()
    finally:
        isa.cpu_isa.cache_clear()
