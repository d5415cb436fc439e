"""Triton prefill/extend attention (interpreter) against a float64 reference:
ragged chunks in one launch, with and without a cached prefix (read from the
pool through the block table), causal within the chunk; fp16/bf16/fp8
pools, GQA group sizes 1/4/8, block sizes 16/32."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[cuda]' or triton)")

from kiln.llm.attention.triton_prefill import BLOCK_M, prefill_attention  # noqa: E402
from tests.unit.llm.attention.paged_reference import prefill_reference, random_pool, random_tables  # noqa: E402

HEAD_DIM = 32
KV_HEADS = 2
# (chunk length, cached prefix): a fresh prompt longer than one query tile,
# a chunk after a prefix-cache hit, one token after a long prefix, a short
# chunk after a prefix that ends inside a block.
CHUNKS = [(BLOCK_M + 9, 0), (20, 48), (1, 150), (7, 21)]
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def case(dtype, group, block_size, seed=0, pool_dtype=None, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    starts, layout = 0, []
    for n, prefix in CHUNKS:
        layout.append((starts, n, prefix))
        starts += n
    prefixes = [prefix for _, prefix in CHUNKS]
    num_blocks = sum(-(-p // block_size) for p in prefixes) + 2
    pool = random_pool(num_blocks, block_size, KV_HEADS, HEAD_DIM, pool_dtype or dtype, g, scale)
    tables = random_tables(prefixes, block_size, num_blocks, g)
    q = torch.randn(starts, KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(starts, KV_HEADS, HEAD_DIM, generator=g).mul(2).to(dtype)
    v = torch.randn(starts, KV_HEADS, HEAD_DIM, generator=g).mul(2).to(dtype)
    return q, k, v, pool, layout, tables


def run(q, k, v, pool, layout, tables, block_size, **kw):
    starts, lens, prefixes = (torch.tensor(c) for c in zip(*layout, strict=True))
    out = torch.full_like(q, float("nan"))
    return prefill_attention(q, k, v, pool[0], pool[1], starts, lens, prefixes, tables, int(lens.max()), block_size,
                             out, dot_f32=q.dtype == torch.bfloat16, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(dtype, group, block_size):
    q, k, v, pool, layout, tables = case(dtype, group, block_size)
    out = run(q, k, v, pool, layout, tables, block_size)
    ref = prefill_reference(q, k, v, pool, layout, tables, block_size)
    torch.testing.assert_close(out.double(), ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_fp8_prefix_with_scales():
    scale_k, scale_v = 0.5, 0.25
    q, k, v, pool, layout, tables = case(torch.float16, 4, 16, seed=1, pool_dtype=torch.float8_e4m3fn, scale=1.0)
    out = run(q, k, v, pool, layout, tables, 16, k_scale=scale_k, v_scale=scale_v)
    ref = prefill_reference(q, k, v, pool.float(), layout, tables, 16, scale_k, scale_v)
    torch.testing.assert_close(out.double(), ref, rtol=4e-3, atol=4e-3)


def test_rows_outside_the_chunks_are_left_alone():
    q, k, v, pool, layout, tables = case(torch.float16, 4, 16, seed=2)
    pad = torch.randn(3, *q.shape[1:]).half()
    q2, k2, v2 = torch.cat([pad, q]), torch.cat([pad[:, :KV_HEADS], k]), torch.cat([pad[:, :KV_HEADS], v])
    shifted = [(start + 3, n, prefix) for start, n, prefix in layout]
    out = run(q2, k2, v2, pool, shifted, tables, 16)
    assert torch.isnan(out[:3]).all()
    assert torch.equal(out[3:], run(q, k, v, pool, layout, tables, 16))
