"""Triton KV write (interpreter): exact against index_copy_ into the pool;
negative slots (CUDA-graph padding) write nothing; fp8 pools store
clamp(x / scale).

Triton 3.9's interpreter rounds fp32 -> e4m3 wrongly at ties and at the top
of each binade (-336 -> -352, -127.99 -> -64; the GPU's conversion
instruction does not), so here the fp8 values are ones e4m3 holds exactly,
plus saturation; tests/gpu checks the rounding of arbitrary values."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[cuda]' or triton)")

from kiln.llm.attention.triton_kv_write import write_kv  # noqa: E402

T, KVH, D, SLOTS = 9, 4, 64, 64


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, KVH, D, generator=g) * 30
    v = torch.randn(T, KVH, D, generator=g) * 30
    slots = torch.randperm(SLOTS, generator=g)[:T]
    return k, v, slots


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_writes_exactly_what_index_copy_writes(dtype):
    k, v, slots = inputs()
    k, v = k.to(dtype), v.to(dtype)
    pool = torch.zeros(2, SLOTS, KVH, D, dtype=dtype)
    write_kv(k, v, pool[0], pool[1], slots)
    expected = torch.zeros_like(pool)
    expected[0].index_copy_(0, slots, k)
    expected[1].index_copy_(0, slots, v)
    assert torch.equal(pool, expected)


def test_strided_inputs_from_a_fused_projection():
    qkv = torch.randn(T, (8 + 2 * KVH) * D)
    _, k, v = qkv.split([8 * D, KVH * D, KVH * D], dim=-1)
    k, v = k.view(T, KVH, D), v.view(T, KVH, D)
    slots = torch.arange(T) * 3
    pool = torch.zeros(2, SLOTS, KVH, D)
    write_kv(k, v, pool[0], pool[1], slots)
    assert torch.equal(pool[0, slots], k) and torch.equal(pool[1, slots], v)


def test_negative_slots_write_nothing():
    k, v, slots = inputs(1)
    slots[::2] = -1
    pool = torch.full((2, SLOTS, KVH, D), 7.0)
    write_kv(k, v, pool[0], pool[1], slots)
    kept = slots >= 0
    assert torch.equal(pool[0, slots[kept]], k[kept])
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert (pool[:, untouched] == 7.0).all()


def test_fp8_pool_stores_scaled_clamped_values():
    k, v, slots = inputs(2)
    k = k.to(torch.float8_e4m3fn).float() * 0.5  # k / 0.5 is exact in e4m3
    v = v.to(torch.float8_e4m3fn).float() * 2.0
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 3.0])  # saturate, not NaN
    pool = torch.zeros(2, SLOTS, KVH, D, dtype=torch.float8_e4m3fn)
    write_kv(k, v, pool[0], pool[1], slots, k_scale=0.5, v_scale=2.0)
    want_k = (k / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
    want_v = (v / 2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(pool[0, slots].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pool[1, slots].view(torch.uint8), want_v.view(torch.uint8))
    assert not torch.isnan(pool.float()).any()
