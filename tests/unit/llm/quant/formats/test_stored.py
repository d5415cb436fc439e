"""The hand-over of pre-quantized projections: Int4Weight's parameter dtype
choice, fusing along the output dimension, and settling the installed
modules for the device and the configured mode."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.layers.linear import Linear
from kiln.llm.quant.formats import stored
from kiln.llm.quant.formats.int4_weight import Int4Weight, PermutedInput, concat_rows, int4_weight
from kiln.llm.quant.formats.stored import StoredWeights, settle_prequantized
from kiln.llm.quant.int4 import Int4Linear
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from tests.unit.llm.quant.formats.compare import int8_activations

CPU = torch.device("cpu")


def parts(n=16, k=128, group=32, seed=0, fp16_exact=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.01 + 0.001).half().float()
    zero = torch.randint(0, 16, (n, k // group), generator=g).float()
    minimum = -8 * scale if fp16_exact else -zero * scale
    return q, scale, minimum


def reference(q, scale, minimum, group=32):
    n, k = q.shape
    return (q.double().reshape(n, k // group, group) * scale.double()[..., None] + minimum.double()[..., None]).reshape(
        n, k).float()


def test_parameters_stay_fp16_only_where_fp16_holds_them():
    for exact in (True, False):
        q, scale, minimum = parts(fp16_exact=exact)
        w = int4_weight(q, scale, minimum, 32, "test")
        assert isinstance(w, Int4Weight)
        assert w.scale_min.dtype == (torch.float16 if exact else torch.float32)
        assert torch.equal(w.dequantize(), reference(q, scale, minimum))


def test_shapes_the_layout_does_not_take_come_back_float():
    q, scale, minimum = parts(k=96)  # K not a multiple of 64
    w = int4_weight(q, scale, minimum, 32, "test")
    assert isinstance(w, torch.Tensor) and torch.equal(w, reference(q, scale, minimum))


def test_fusing_promotes_to_fp32_and_refuses_unlike_pieces():
    a = int4_weight(*parts(seed=1), 32, "A")
    b = int4_weight(*parts(seed=2, fp16_exact=False), 32, "B")
    assert isinstance(a, Int4Weight) and isinstance(b, Int4Weight)
    fused = concat_rows([a, b])
    assert fused is not None and fused.scale_min.dtype == torch.float32 and fused.source == "A+B"
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    other_group = int4_weight(*parts(group=64, seed=3), 64, "C")
    assert isinstance(other_group, Int4Weight)
    assert concat_rows([a, other_group]) is None
    weights = StoredWeights({"c.weight": torch.randn(16, 128)}, {"a.weight": a, "g.weight": other_group})
    mixed = weights.projection(["a.weight", "c.weight"])  # quantized + float: float, exact
    assert isinstance(mixed, torch.Tensor)
    assert torch.equal(mixed, torch.cat([a.dequantize(), weights.weights["c.weight"]]))
    assert isinstance(weights.projection(["a.weight", "g.weight"]), torch.Tensor)


def model_with(weight: Int4Weight) -> nn.Module:
    model = nn.Module()
    model.proj = weight.module()
    return model


def permuted_weight():
    q, scale, minimum = parts(fp16_exact=False)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    w = int4_weight(q, scale, minimum, 32, "test", perm)
    assert isinstance(w, Int4Weight)
    return w


def test_a_permuted_layer_computes_with_the_checkpoint_order():
    w = permuted_weight()
    x = torch.randn(3, 128)
    ref = F.linear(x, w.dequantize())
    torch.testing.assert_close(w.module()(x), ref, rtol=1e-5, atol=1e-5)
    with int8_activations():  # ~1% of the largest output
        torch.testing.assert_close(w.module()(x), ref, rtol=0, atol=0.03 * ref.abs().max().item())


def test_settling_keeps_dequantizes_or_falls_back_to_torchs_int4(monkeypatch):
    w = permuted_weight()
    x = torch.randn(3, 128)
    ref = F.linear(x, w.dequantize())

    kept = model_with(w)
    settle_prequantized(kept, CPU, keep=True)
    assert isinstance(kept.proj, PermutedInput) and isinstance(kept.proj.inner, Int4CpuLinear)

    floated = model_with(w)
    settle_prequantized(floated, CPU, keep=False)
    assert isinstance(floated.proj, Linear) and torch.equal(floated.proj.weight, w.dequantize())

    monkeypatch.setattr(stored, "kernels_loaded", lambda: False)  # e.g. the library is not built
    torch_int4 = model_with(w)
    settle_prequantized(torch_int4, CPU, keep=True)
    assert isinstance(torch_int4.proj, PermutedInput) and isinstance(torch_int4.proj.inner, Int4Linear)
    # bf16 scale and zero, bf16 activations: close, not equal
    torch.testing.assert_close(torch_int4.proj(x), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
