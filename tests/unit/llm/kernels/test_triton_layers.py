"""Kiln's Triton layer kernels (interpreter, CPU tensors) against the torch
reference layers they replace on CUDA, in fp16 and bf16.

fp16 results are bit-exact. Triton 3.9's interpreter truncates fp32 -> bf16
(a GPU rounds to nearest even), so bf16 results may differ from torch's by
the rounding of each of their (at most two) roundings: two bf16 units."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[cuda]' or triton)")

from kiln.llm.kernels import triton_layers  # noqa: E402
from kiln.llm.layers.norm import reference_rms_norm  # noqa: E402
from kiln.llm.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]


def assert_same(got, want):
    if got.dtype == torch.float16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-5)


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    assert_same(triton_layers.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_rounds_the_sum_first(dtype):
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(4, 80, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(80, generator=g).to(dtype)
    normed, total = triton_layers.add_rms_norm(x, res, w, 1e-6)
    assert_same(total, x + res)
    assert_same(normed, reference_rms_norm(total, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_views_of_a_fused_projection(dtype):
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, t = 4, 2, 32, 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    cos, sin = rope.tables(torch.tensor([0, 3, 7, 8, 30, 63]))
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    triton_layers.rotary_(q, k, cos, sin)
    # fp32 products may fuse into FMAs: a unit in the last place at most
    torch.testing.assert_close(q, want_q, rtol=2**-6, atol=1e-3)
    torch.testing.assert_close(k, want_k, rtol=2**-6, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 2 * 1500, generator=g) * 4).to(dtype)  # two column blocks, ragged
    gate, up = gate_up.split(1500, dim=-1)
    got, want = triton_layers.silu_mul(gate_up), F.silu(gate) * up
    torch.testing.assert_close(got, want, rtol=2**-6 if dtype == torch.bfloat16 else 2**-9, atol=1e-3)
