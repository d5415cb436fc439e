"""kv_write.cpp: a step's keys and values into the paged pool, exactly as
`pool.index_copy_(0, slot_mapping, rows.to(pool.dtype))` writes them, for
every pool dtype, strided rows (a fused qkv's views) and a bad slot."""
import pytest
import torch

from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")


def fused_kv(rows, kv_heads, head_dim, dtype, seed=0):
    """k, v as the attention layer gets them: views into one [T, (H + 2 KVH) D] projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (2 + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    k = qkv[:, 2 * head_dim : (2 + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (2 + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    return k, v


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_writes_what_index_copy_writes(rows_dtype, pool_dtype, rows):
    kv_heads, head_dim = 3, 64
    k, v = fused_kv(rows, kv_heads, head_dim, rows_dtype, seed=rows)
    pool = torch.randn(2, 512, kv_heads, head_dim).to(pool_dtype)
    slots = torch.randperm(512, generator=torch.Generator().manual_seed(rows))[:rows]
    expected = pool.clone()
    expected[0].index_copy_(0, slots, k.to(pool_dtype))
    expected[1].index_copy_(0, slots, v.to(pool_dtype))
    assert ops.write_kv(pool[0], pool[1], k, v, slots)
    assert torch.equal(pool, expected)


def test_a_slot_outside_the_pool_is_an_error_and_writes_nothing():
    k, v = fused_kv(4, 2, 16, torch.float32)
    pool = torch.zeros(2, 32, 2, 16)
    with pytest.raises(RuntimeError, match="slot 32 outside the pool"):
        ops.write_kv(pool[0], pool[1], k, v, torch.tensor([0, 5, 32, 1]))
    assert not pool.any()


def test_rows_of_another_head_layout_are_refused():
    k, v = fused_kv(4, 2, 16, torch.float32)
    pool = torch.zeros(2, 32, 3, 16)
    with pytest.raises(RuntimeError, match="must match the pool"):
        ops.write_kv(pool[0], pool[1], k, v, torch.arange(4))


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_fp32_rows_round_into_a_16_bit_pool_bit_for_bit(pool_dtype):
    """fp32 rows are rounded as they are stored (no temporary): the bits of
    `rows.to(pool_dtype)` for ties, subnormals, overflow and infinities; a NaN
    stays a NaN (bf16: 0x7fc0, as c10::BFloat16(float); torch's vectorized
    cast writes 0xffff)."""
    info = torch.finfo(pool_dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, info.max * 1.5,
                            info.tiny / 3, 1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, 1.0 + 2.0**-12, 65520.0, -65519.0])
    k, v = fused_kv(3, 2, 32, torch.float32, seed=1)
    k[1].view(-1)[: special.numel()] = special
    v[2].view(-1)[-special.numel() :] = special
    pool = torch.zeros(2, 16, 2, 32, dtype=pool_dtype)
    slots = torch.tensor([9, 0, 15])
    assert ops.write_kv(pool[0], pool[1], k, v, slots)
    for side, rows in ((0, k), (1, v)):
        stored, expected = pool[side, slots], rows.to(pool_dtype)
        nan = rows.isnan()
        assert stored[nan].isnan().all() and nan.sum() == 1
        assert torch.equal(stored[~nan].view(torch.int16), expected[~nan].view(torch.int16))
