"""Triton decode attention (interpreter) against a float64 reference on the
values the pool holds: fp16/bf16/fp8 pools, GQA group sizes 1/4/8, block
sizes 16/32, ragged contexts, split-K on and off."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[cuda]' or triton)")

from kiln.llm.attention.triton_decode import MIN_SPLIT_TOKENS, decode_attention, max_splits_for  # noqa: E402
from tests.unit.llm.attention.paged_reference import decode_reference, random_pool, random_tables  # noqa: E402

HEAD_DIM = 64
KV_HEADS = 2
LENS = [1, 16, 33, MIN_SPLIT_TOKENS + 44]  # one token, a block boundary, ragged, two splits
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}  # a few roundings of q, p


def case(dtype, group, block_size, seed=0, lens=LENS, pool_dtype=None, k_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    pool = random_pool(num_blocks, block_size, KV_HEADS, HEAD_DIM, pool_dtype or dtype, g, k_scale)
    tables = random_tables(lens, block_size, num_blocks, g)
    q = torch.randn(len(lens), KV_HEADS * group, HEAD_DIM, generator=g).to(dtype)
    return q, pool, tables, torch.tensor(lens)


def run(q, pool, tables, lens, block_size, max_splits, **kw):
    out = torch.empty_like(q)
    dot_f32 = q.dtype != torch.float16  # bf16 through the fp32 variant: the interpreter's bf16 dot is wrong
    return decode_attention(q, pool[0], pool[1], tables, lens, block_size, max_splits, out, dot_f32=dot_f32, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(dtype, group, block_size):
    check_against_reference(dtype, group, block_size, max_splits=4)


@pytest.mark.parametrize("dtype,group,block_size", [(torch.float16, 4, 16), (torch.bfloat16, 8, 32)])
def test_matches_reference_in_one_split(dtype, group, block_size):
    check_against_reference(dtype, group, block_size, max_splits=1)


def check_against_reference(dtype, group, block_size, max_splits):
    q, pool, tables, lens = case(dtype, group, block_size)
    out = run(q, pool, tables, lens, block_size, max_splits)
    assert out.dtype == dtype
    ref = decode_reference(q, pool, tables, lens.tolist(), block_size)
    torch.testing.assert_close(out.double(), ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_fp8_pool_with_per_tensor_scales():
    k_scale, v_scale = 0.05, 0.02
    g = torch.Generator().manual_seed(3)
    q, pool16, tables, lens = case(torch.float16, 4, 16, seed=3)
    keys = torch.randn(pool16.shape[1:], generator=g) * 0.2  # real-sized keys, stored / scale
    values = torch.randn(pool16.shape[1:], generator=g) * 0.2
    pool = torch.stack([(keys / k_scale).clamp(-448, 448), (values / v_scale).clamp(-448, 448)])
    pool = pool.to(torch.float8_e4m3fn)
    out = run(q, pool, tables, lens, 16, 4, k_scale=k_scale, v_scale=v_scale)
    ref = decode_reference(q, pool.float(), tables, lens.tolist(), 16, k_scale, v_scale)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-3)
    # and e4m3 rounding stays close to the unrounded values
    exact = decode_reference(q, torch.stack([keys, values]), tables, lens.tolist(), 16)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=0.03)


def test_split_k_agrees_with_one_split():
    q, pool, tables, lens = case(torch.float32, 4, 16, seed=1, lens=[600, 1100, 7])
    one = run(q, pool, tables, lens, 16, 1)
    many = run(q, pool, tables, lens, 16, 8)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_its_batch_or_padding():
    """What CUDA graphs rely on: the same row, alone or among padded rows of
    context 0 and a wider table, gives bit-identical output."""
    q, pool, tables, lens = case(torch.float16, 4, 16, seed=2)
    full = run(q, pool, tables, lens, 16, 4)
    padded_tables = torch.nn.functional.pad(tables, (0, 7))
    padded_q = torch.cat([q, torch.randn(3, *q.shape[1:]).half()])
    padded = run(padded_q, pool, torch.cat([padded_tables, torch.zeros(3, padded_tables.shape[1]).long()]),
                 torch.cat([lens, torch.zeros(3, dtype=torch.long)]), 16, 4)
    assert torch.equal(padded[: len(lens)], full)
    assert torch.equal(padded[len(lens) :], torch.zeros_like(padded[len(lens) :]))  # context 0 -> 0
    alone = run(q[3:4], pool, tables[3:4], lens[3:4], 16, 4)
    assert torch.equal(alone, full[3:4])


def test_max_splits_is_the_same_for_a_batch_and_its_padded_graph_size():
    for n in range(1, 257):
        bucket = 1 << (n - 1).bit_length()
        assert max_splits_for(n, 8, 132) == max_splits_for(bucket, 8, 132)
    assert max_splits_for(1, 8, 132) == 16 and max_splits_for(64, 8, 132) == 1
