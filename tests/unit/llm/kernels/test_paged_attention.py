"""Kiln's paged decode attention kernel against the torch reference path
(gather the blocks, SDPA with a length mask). fp32 queries; pools in fp32,
fp16 or bf16 against the reference on the same pool widened to fp32 (the
kernel computes in fp32 on the stored values): tolerance 1e-5. 16-bit
queries: the fp32 result rounded once (within half a 16-bit step). bf16
queries on a bf16 pool in the avx512_bf16 build score on bf16 dot products
(two head dims a lane), which agree with the fp32 chains to rounding."""
import pytest
import torch
import torch.nn.functional as F

from kiln.llm.attention.backend import gather_blocks
from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")

BLOCK = 16


def reference(q, k_pool, v_pool, tables, lens):
    keys = gather_blocks(k_pool, tables, BLOCK).transpose(1, 2)
    values = gather_blocks(v_pool, tables, BLOCK).transpose(1, 2)
    mask = (torch.arange(tables.shape[1] * BLOCK)[None] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True).squeeze(2)


def random_case(seed, batch, heads, kv_heads, head_dim, max_len, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=g)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    width = -(-int(lens.max()) // BLOCK)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim, generator=g) * 3  # sharp softmax: exercises the exp range
    return q, k_pool, v_pool, tables, lens


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (32, 8, 128)]
)
def test_matches_gather_and_sdpa(heads, kv_heads, head_dim):
    case = random_case(heads * head_dim, batch=7, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_len=300)
    out = ops.paged_decode_attention(*case, BLOCK)
    assert out is not None
    torch.testing.assert_close(out, reference(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_16_bit_pools_match_the_reference_on_the_widened_pool(pool_dtype, heads, kv_heads, head_dim):
    q, k_pool, v_pool, tables, lens = random_case(5, batch=7, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                  max_len=300)
    k16, v16 = k_pool.to(pool_dtype), v_pool.to(pool_dtype)
    out = ops.paged_decode_attention(q, k16, v16, tables, lens, BLOCK)
    assert out is not None and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(q, k16.float(), v16.float(), tables, lens), rtol=1e-5, atol=1e-5)
    # and the rounding of the pool itself moves the result only a little
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, tables, lens), rtol=0, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [7, 1])  # 1: fewer sequences than threads, work split by kv head
def test_16_bit_queries_give_the_fp32_result_rounded_once(dtype, batch):
    # A 16-bit model's queries widen exactly; the output is rounded once, as
    # the torch path's SDPA in that dtype rounds its output.
    q, k_pool, v_pool, tables, lens = random_case(6, batch=batch, heads=9, kv_heads=3, head_dim=64, max_len=300)
    q16, k16, v16 = q.to(dtype), k_pool.to(dtype), v_pool.to(dtype)
    out = ops.paged_decode_attention(q16, k16, v16, tables, lens, BLOCK)
    assert out is not None and out.dtype == dtype
    from_fp32_queries = ops.paged_decode_attention(q16.float(), k16, v16, tables, lens, BLOCK)
    if dtype == torch.bfloat16 and ops.bf16_dot_products():  # other sums of the same products: one step at most
        assert ((out.float() - from_fp32_queries).abs() <= from_fp32_queries.abs() * 2**-7 + 1e-6).all()
    else:
        assert torch.equal(out, from_fp32_queries.to(dtype))
    exact = reference(q16.float(), k16.float(), v16.float(), tables, lens)
    half_step = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert ((out.float() - exact).abs() <= exact.abs() * half_step + 1e-5).all()
    # SDPA in the 16-bit dtype (the torch path) rounds intermediates too: further off
    torch.testing.assert_close(out, reference(q16, k16, v16, tables, lens), rtol=0, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_read_in_place_from_a_fused_qkv_row(dtype):
    # The decode layer passes q as a narrow of its qkv projection (rows strided):
    # read in place, the same result as from a contiguous copy.
    q, k_pool, v_pool, tables, lens = random_case(8, batch=5, heads=9, kv_heads=3, head_dim=64, max_len=100)
    qkv = torch.cat([q.reshape(5, -1), torch.randn(5, 2 * 3 * 64)], dim=1).to(dtype)
    view = qkv.narrow(1, 0, 9 * 64).view(5, 9, 64)
    assert not view.is_contiguous()
    k, v = k_pool.to(dtype), v_pool.to(dtype)
    out = ops.paged_decode_attention(view, k, v, tables, lens, BLOCK)
    assert torch.equal(out, ops.paged_decode_attention(view.contiguous(), k, v, tables, lens, BLOCK))


def test_single_token_context_and_block_boundaries():
    q, k_pool, v_pool, tables, _ = random_case(1, batch=4, heads=9, kv_heads=3, head_dim=64, max_len=64)
    lens = torch.tensor([1, BLOCK, BLOCK + 1, 2 * BLOCK])
    tables = tables[:, :2]
    torch.testing.assert_close(
        ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, BLOCK),
        reference(q, k_pool, v_pool, tables, lens), rtol=1e-5, atol=1e-5,
    )


def test_rows_do_not_depend_on_the_batch():
    q, k_pool, v_pool, tables, lens = random_case(2, batch=6, heads=9, kv_heads=3, head_dim=64, max_len=200)
    full = ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, BLOCK)
    width = -(-int(lens[3]) // BLOCK)
    alone = ops.paged_decode_attention(q[3:4], k_pool, v_pool, tables[3:4, :width], lens[3:4], BLOCK)
    assert torch.equal(alone, full[3:4])


def test_declines_what_it_does_not_handle():
    q, k_pool, v_pool, tables, lens = random_case(3, batch=2, heads=4, kv_heads=2, head_dim=12, max_len=20)
    assert ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, BLOCK) is None  # head_dim % 8
    q, k_pool, v_pool, tables, lens = random_case(4, batch=2, heads=4, kv_heads=2, head_dim=16, max_len=20)
    assert ops.paged_decode_attention(q.double(), k_pool.double(), v_pool.double(), tables, lens, BLOCK) is None
    assert ops.paged_decode_attention(q, k_pool.double(), v_pool.double(), tables, lens, BLOCK) is None


@pytest.fixture
def two_threads():
    # The kernel splits a sequence's work between threads only where its items
    # cannot be shared evenly: force two threads so that happens on any box.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def long_case(seed, lens, num_blocks=400):
    """random_case's tensors with these context lengths (block tables wide enough)."""
    q, k_pool, v_pool, _, _ = random_case(seed, batch=len(lens), heads=9, kv_heads=3, head_dim=64, max_len=1,
                                          num_blocks=num_blocks)
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // BLOCK)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    return q, k_pool, v_pool, tables, torch.tensor(lens)


def test_rows_sorted_by_context_get_the_bits_they_get_alone(two_threads):
    # Decode rows come sorted by context; the threads take runs of rows of
    # about equal keys (here the first thread the six rows up to 400 keys,
    # the second the 700-key one), which must not change any row's bits.
    lens = [5, 9, 20, 33, 60, 400, 700]
    q, k_pool, v_pool, tables, lens_t = long_case(11, lens)
    full = ops.paged_decode_attention(q, k_pool, v_pool, tables, lens_t, BLOCK)
    for b, n in enumerate(lens):
        width = -(-n // BLOCK)
        alone = ops.paged_decode_attention(q[b:b + 1], k_pool, v_pool, tables[b:b + 1, :width], lens_t[b:b + 1], BLOCK)
        assert torch.equal(alone, full[b:b + 1])
    torch.testing.assert_close(full, reference(q, k_pool, v_pool, tables, lens_t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(0, None), (300, 20.0)])
def test_a_split_sequence_gets_the_bits_of_an_unsplit_one(two_threads, pool_dtype, window, softcap):
    # One sequence's 3 kv heads on 2 threads are split by key range for the
    # scores and by head dimension for the values; rows of a batch of 6 (or 3)
    # are not. Same chains of FMAs: equal bits, and the reference's values.
    q, k_pool, v_pool, tables, lens = long_case(9, [1000, 37, 700, 400, 999, 257])
    k, v = k_pool.to(pool_dtype), v_pool.to(pool_dtype)
    full = ops.paged_decode_attention(q, k, v, tables, lens, BLOCK, window=window, softcap=softcap)
    for rows in (slice(0, 1), slice(5, 6), slice(2, 5)):
        part = ops.paged_decode_attention(q[rows], k, v, tables[rows], lens[rows], BLOCK, window=window,
                                          softcap=softcap)
        assert torch.equal(part, full[rows])
    if window == 0 and softcap is None:
        torch.testing.assert_close(full, reference(q, k.float(), v.float(), tables, lens), rtol=1e-5, atol=1e-5)


def test_a_split_sequence_with_16_bit_queries(two_threads):
    q, k_pool, v_pool, tables, lens = long_case(10, [600, 600, 600, 600])
    q16, k16, v16 = q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16()
    full = ops.paged_decode_attention(q16, k16, v16, tables, lens, BLOCK)
    alone = ops.paged_decode_attention(q16[:1], k16, v16, tables[:1], lens[:1], BLOCK)
    assert alone.dtype == torch.bfloat16 and torch.equal(alone, full[:1])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 3), (8, 2), (14, 2)])  # runs of 8, 4, 2 and 1 keys
@pytest.mark.parametrize("lens", [[83, 29], [301, 5]])
def test_runs_of_keys_scored_together_keep_each_scores_bits(two_threads, heads, kv_heads, lens):
    # Alone (fewer sequences than threads) an item is one kv head, its keys
    # scored several at a time (29 and 5 keys, and every length where the kv
    # heads share evenly between the threads; 83 and 301 keys over 3 kv heads
    # are split instead, by key ranges of all heads, in the avx2 build, which
    # splits from 48 keys: paged_attention.cpp's kSplitMinKeys); in a batch of two an
    # item holds every kv head and scores one key at a time. Each score is
    # the same chain of FMAs: equal bits, also for a window that starts
    # mid-block.
    q, k_pool, v_pool, _, _ = random_case(heads, batch=2, heads=heads, kv_heads=kv_heads, head_dim=64, max_len=1)
    g = torch.Generator().manual_seed(heads)
    tables = torch.stack([torch.randperm(64, generator=g)[:20] for _ in lens])
    lens_t = torch.tensor(lens)
    for window in (0, 23):
        full = ops.paged_decode_attention(q, k_pool, v_pool, tables, lens_t, BLOCK, window=window)
        for b in range(2):
            alone = ops.paged_decode_attention(q[b:b + 1], k_pool, v_pool, tables[b:b + 1], lens_t[b:b + 1], BLOCK,
                                               window=window)
            assert torch.equal(alone, full[b:b + 1])
        if window == 0:
            torch.testing.assert_close(full, reference(q, k_pool, v_pool, tables, lens_t), rtol=1e-5, atol=1e-5)


def paged(keys, values, block_size, seed):
    """keys, values [L, KVH, D] of one sequence laid out in a pool of blocks of
    `block_size` slots in a random order: (k_pool, v_pool, table [1, blocks])."""
    blocks = -(-keys.shape[0] // block_size)
    order = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(seed))[:blocks]
    k_pool = torch.zeros((blocks + 3) * block_size, *keys.shape[1:], dtype=keys.dtype)
    v_pool = torch.zeros_like(k_pool)
    for i, block in enumerate(order.tolist()):
        rows = slice(i * block_size, min((i + 1) * block_size, keys.shape[0]))
        n = rows.stop - rows.start
        k_pool[block * block_size:block * block_size + n] = keys[rows]
        v_pool[block * block_size:block * block_size + n] = values[rows]
    return k_pool, v_pool, order.view(1, -1)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (14, 2)])  # scores summed 8, 4 and 1 at a time
@pytest.mark.parametrize("length", [29, 61])
@pytest.mark.parametrize("q_dtype,pool_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_the_block_size_changes_no_bits(heads, kv_heads, length, q_dtype, pool_dtype):
    # Where a block starts decides which keys are summed together (runs of 8
    # or 4 from a block's start, one at a time in its tail): blocks of 16 and
    # 12 slots put keys 8-11 in a run and alone. Each score is one chain of
    # FMAs (or bf16 dot products: bf16 on bf16) with its lanes summed in one
    # fixed order either way: equal bits. (A bf16 output hides most fp32-level
    # differences: the bf16 case guards the dot path's runs and tails against
    # gross slips, the fp16 case the bits.)
    g = torch.Generator().manual_seed(heads + length)
    keys = torch.randn(length, kv_heads, 64, generator=g).to(pool_dtype)
    values = torch.randn(length, kv_heads, 64, generator=g).to(pool_dtype)
    q = (torch.randn(1, heads, 64, generator=g) * 3).to(q_dtype)
    lens = torch.tensor([length])
    outs = []
    for block_size in (16, 12, 8):
        k_pool, v_pool, table = paged(keys, values, block_size, seed=block_size)
        outs.append(ops.paged_decode_attention(q, k_pool, v_pool, table, lens, block_size))
        batch = ops.paged_decode_attention(q.repeat(2, 1, 1), k_pool, v_pool, table.repeat(2, 1), lens.repeat(2),
                                           block_size)  # items of all kv heads
        assert torch.equal(batch[:1], outs[-1]) and torch.equal(batch[1:], outs[-1])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
