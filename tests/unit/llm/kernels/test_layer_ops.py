"""Fused RMSNorm / residual add / rotary / SwiGLU kernels against the torch
reference code they replace (kiln.llm.layers), to float rounding.

Tolerances: the norm sums squares in another order (relative 1e-6); SiLU
uses a polynomial exp (relative ~2e-7, so 1e-6 on outputs of order 1).
bf16: fp32 arithmetic inside, rounded where torch's bf16 reference rounds,
so outputs are equal to it but for a rare one-step (2^-7 relative)
difference where those fp32 discrepancies straddle a rounding boundary.
"""
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kiln.llm.kernels import isa, ops
from kiln.llm.kernels.build import BUILDS, cpu_supported
from kiln.llm.layers.norm import RMSNorm, reference_rms_norm
from kiln.llm.layers.rotary import RotaryEmbedding, _rotate

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")


@pytest.mark.parametrize("rows, dim", [(1, 576), (37, 576), (5, 13)])
def test_rms_norm_matches_reference(rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)


def test_add_rms_norm_returns_norm_of_sum_and_the_sum():
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(9, 576, generator=g), torch.randn(9, 576, generator=g), torch.randn(576, generator=g)
    normed, total = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, x + res)
    torch.testing.assert_close(normed, reference_rms_norm(x + res, w, 1e-6), rtol=1e-5, atol=1e-6)
    layer = RMSNorm(576, 1e-6)
    layer.weight.data.copy_(w)
    fused = layer.add_forward(x, res)
    torch.testing.assert_close(fused[0], normed, rtol=0, atol=0)


def test_rotary_in_place_on_strided_views_of_a_fused_projection():
    g = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, d = 7, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    rope = RotaryEmbedding(d, 128, 10000.0, None)
    cos, sin = rope.tables(torch.tensor([0, 1, 5, 17, 3, 100, 127]))
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    want_q, want_k, v_before = _rotate(q.clone(), cos, sin), _rotate(k.clone(), cos, sin), v.clone()
    assert ops.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_before)  # the value slice of qkv is untouched


def test_silu_mul_matches_reference_over_a_wide_range():
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(6, 2 * 1539, generator=g) * 12  # odd width: the scalar tail too
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    gate, up = gate_up.split(1539, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(40, 576, generator=g), torch.randn(576, generator=g)
    gu = torch.randn(40, 3072, generator=g)
    assert torch.equal(ops.rms_norm(x, w, 1e-5)[7], ops.rms_norm(x[7:8], w, 1e-5)[0])
    assert torch.equal(ops.silu_mul(gu)[7], ops.silu_mul(gu[7:8])[0])


def assert_bf16_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2**-7 + 1e-30).all()  # at most one bf16 step
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("rows, dim", [(1, 576), (37, 576), (5, 13)])
def test_bf16_rms_norm_rounds_before_the_weight_multiply_like_the_reference(rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x, w = (torch.randn(rows, dim, generator=g) * 3).bfloat16(), torch.randn(dim, generator=g).bfloat16()
    assert_bf16_matches(ops.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))
    layer = RMSNorm(dim, 1e-5).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    assert torch.equal(layer(x), ops.rms_norm(x, w, 1e-5))  # the module takes the kernel


def test_bf16_add_rms_norm_sums_as_torch_does():
    g = torch.Generator().manual_seed(11)
    x, res = torch.randn(9, 576, generator=g).bfloat16(), torch.randn(9, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    normed, total = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, x + res)
    assert_bf16_matches(normed, reference_rms_norm(x + res, w, 1e-6))


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])  # a bf16 model's tables are bf16
def test_bf16_rotary_in_place_rounds_once(table_dtype):
    g = torch.Generator().manual_seed(12)
    tokens, heads, kv_heads, d = 7, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    rope = RotaryEmbedding(d, 128, 10000.0, None).to(table_dtype)
    cos, sin = rope.tables(torch.tensor([0, 1, 5, 17, 3, 100, 127]))
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    want_q, want_k, v_before = _rotate(q.clone(), cos, sin), _rotate(k.clone(), cos, sin), v.clone()
    assert ops.rotary_(q, k, cos, sin)
    assert_bf16_matches(q, want_q)
    assert_bf16_matches(k, want_k)
    assert torch.equal(v, v_before)


def test_bf16_silu_mul_rounds_silu_before_the_multiply_like_torch():
    g = torch.Generator().manual_seed(13)
    gate_up = (torch.randn(6, 2 * 1539, generator=g) * 12).bfloat16()
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    gate, up = gate_up.split(1539, dim=-1)
    assert_bf16_matches(ops.silu_mul(gate_up), F.silu(gate) * up)


def test_bf16_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(14)
    x, w = torch.randn(40, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()
    gu = torch.randn(40, 3072, generator=g).bfloat16()
    assert torch.equal(ops.rms_norm(x, w, 1e-5)[7], ops.rms_norm(x[7:8], w, 1e-5)[0])
    assert torch.equal(ops.silu_mul(gu)[7], ops.silu_mul(gu[7:8])[0])


def test_other_dtypes_fall_back():
    x = torch.randn(2, 16, dtype=torch.float16)
    assert ops.rms_norm(x, torch.ones(16, dtype=torch.float16), 1e-5) is None
    assert ops.rms_norm(x.bfloat16(), torch.ones(16), 1e-5) is None  # mixed dtypes
    assert ops.silu_mul(x) is None
    assert ops.silu_mul(x.double()) is None
    q = torch.randn(2, 3, 16, dtype=torch.float16)
    cos = torch.ones(2, 1, 8, dtype=torch.float16)
    assert not ops.rotary_(q, q.clone(), cos, cos)
    assert not ops.rotary_(q.bfloat16(), q.bfloat16(), cos, cos)  # fp16 tables


WIDTH_PROBE = """
import io, sys, torch
from kiln.llm.kernels import ops
assert ops.kernels_loaded()
g = torch.Generator().manual_seed(0)
out = {"library": ops.loaded_library()}
for dt in (torch.float32, torch.bfloat16):
    gu = (torch.randn(7, 2 * 1549, generator=g) * 6).to(dt)  # 1549: sixteen-, eight-lane and scalar parts
    gu[0, :8] = torch.tensor([float("nan"), -0.0, 0.0, -200.0, 200.0, 1e-39, -1e-39, float("inf")]).to(dt)
    out[f"silu {dt}"] = torch.ops.kiln.silu_mul(gu)
    out[f"gelu {dt}"] = torch.ops.kiln.gelu_tanh_mul(gu)
buffer = io.BytesIO()
torch.save(out, buffer)
sys.stdout.buffer.write(buffer.getvalue())
"""


def _gated_outputs(env_isa):
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_ISA", "KILN_KERNELS")}
    if env_isa:
        env["KILN_ISA"] = env_isa
    done = subprocess.run([sys.executable, "-c", WIDTH_PROBE], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return torch.load(io.BytesIO(done.stdout))


def _both_builds_unavailable():
    return (not all(b.library.exists() for b in BUILDS.values()) or not isa.cpu_isa().at_least("avx512_bf16")
            or isa.cpu_isa().forced)


@pytest.mark.skipif(_both_builds_unavailable(), reason="needs an AVX512_BF16 CPU, both kernel builds and no KILN_ISA")
def test_sixteen_lane_activations_equal_the_avx2_builds_bit_for_bit():
    """The avx512_bf16 build runs SiLU / GELU-tanh gating sixteen lanes at a time, the avx2 build eight:
    the same operations lane for lane, so every value (NaN, signed zeros, denormals, saturated exp and
    the scalar tail included) is the same bits. Fresh processes: a process loads one build for good."""
    wide, narrow = _gated_outputs(None), _gated_outputs("avx2")
    assert (wide.pop("library"), narrow.pop("library")) == ("avx512_bf16", "avx2")
    for name, values in wide.items():
        bits = torch.int32 if values.dtype == torch.float32 else torch.int16
        assert torch.equal(values.view(bits), narrow[name].view(bits)), name
