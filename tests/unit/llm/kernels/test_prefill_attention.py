"""Kiln's causal prefill attention kernel (prefill_attention.cpp) against an
fp64 reference (softmax attention with the causal / window mask written
out), and its place in the attention backend: a chunk with cached context,
a sliding window and soft-capped scores, and a whole engine run against
torch's SDPA path. The kernel computes in fp32 on 16-bit values widened
exactly, so 16-bit outputs are within one rounding of the reference; bf16
on AVX512_BF16 (prefill_attention_bf16.cpp) also rounds each softmax weight
to bf16, as torch's SDPA does, which adds at most one bf16 rounding of
sum_c p_c |v_c| to an output."""
import pytest
import torch

from kiln.llm.attention.backend import TorchPagedAttention
from kiln.llm.attention.metadata import AttentionMetadata, PrefillSeq
from kiln.llm.attention.options import AttentionOptions
from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")

# fp32 to float rounding; 16-bit outputs within half a step of their dtype (relative) of the fp32 result.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def reference(q, k, v, scale, window=0, softcap=None):
    """q [Q, H, D] over k, v [L, KVH, D], the last Q keys the rows' own; fp64."""
    rows, keys = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(rows).unsqueeze(1) + keys - rows
    k_pos = torch.arange(keys).unsqueeze(0)
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v64)


def assert_matches_reference(out, q, k, v, scale, window=0, softcap=None):
    """Within one rounding of out's dtype of the fp64 reference; bf16 weights
    (the AVX512_BF16 kernel) may add one bf16 rounding of sum_c p_c |v_c|."""
    expected = reference(q, k, v, scale, window, softcap)
    if out.dtype != torch.bfloat16 or not ops.bf16_dot_products():
        torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[out.dtype], atol=1e-5)
        return
    weighted_magnitude = reference(q, k, v.abs(), scale, window, softcap)
    error = (out.double() - expected).abs()
    bound = 2**-8 * (expected.abs() + weighted_magnitude) + 1e-5
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.3f}"


def random_qkv(seed, rows, keys, heads, kv_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, head_dim, generator=g) * 2  # a sharp softmax exercises the exp range
    k = torch.randn(keys, kv_heads, head_dim, generator=g)
    v = torch.randn(keys, kv_heads, head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows,keys,heads,kv_heads,head_dim,window,softcap",
    [
        (1, 1, 9, 3, 64, 0, None),
        (5, 5, 9, 3, 64, 0, None),
        (37, 37, 9, 3, 64, 0, None),  # a tile and a part, key blocks with a tail
        (300, 300, 9, 3, 64, 0, None),
        (17, 100, 8, 8, 128, 0, None),  # cached context before the chunk
        (50, 80, 4, 1, 64, 16, None),  # sliding window
        (33, 33, 8, 2, 256, 0, 30.0),  # soft-capped scores (Gemma 2's head_dim)
        (70, 200, 9, 3, 64, 40, 50.0),  # all three
        (3, 3, 16, 2, 16, 0, None),  # 8 query heads per kv head, the smallest head_dim
        (20, 21, 4, 2, 48, 0, None),  # three 16-dim chunks, an odd key count
        (19, 61, 4, 2, 80, 7, None),  # five chunks (a pass of four and one), a window inside a key block
    ],
)
def test_matches_the_fp64_reference(dtype, rows, keys, heads, kv_heads, head_dim, window, softcap):
    q, k, v = random_qkv(rows * keys + heads, rows, keys, heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = ops.prefill_attention(q, k, v, scale, window, softcap)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    assert_matches_reference(out, q, k, v, scale, window, softcap)


def test_reads_strided_rows_of_a_fused_qkv_and_ignores_the_thread_split():
    heads, kv_heads, head_dim, rows = 9, 3, 64, 45
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.prefill_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = ops.prefill_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, ops.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 37])
def test_a_row_gets_the_same_bits_in_any_chunk(dtype, window):
    """A prompt's last rows attended as a chunk after cached context (a
    prefix-cache hit, a chunked prefill) equal the same rows of the whole
    prompt in one call: a row's result depends only on its own keys."""
    q, k, v = random_qkv(5, 150, 150, 9, 3, 64, dtype)
    whole = ops.prefill_attention(q, k, v, 0.125, window)
    for tail in (1, 17, 40, 133):
        assert torch.equal(ops.prefill_attention(q[-tail:], k, v, 0.125, window), whole[-tail:])


def test_does_not_apply_where_it_cannot_run():
    q, k, v = random_qkv(0, 4, 4, 4, 2, 64, torch.float32)
    assert ops.prefill_attention(q, k.to(torch.bfloat16), v, 0.125) is None  # mixed dtypes
    q8, k8, v8 = random_qkv(0, 4, 4, 4, 2, 8, torch.float32)
    assert ops.prefill_attention(q8, k8, v8, 0.125) is None  # head_dim not a multiple of 16


def test_rejects_fewer_keys_than_rows():
    q, k, v = random_qkv(0, 8, 4, 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="must include the chunk's own 8 rows"):
        ops.prefill_attention(q, k, v, 0.125)


@pytest.mark.parametrize("options", [AttentionOptions(), AttentionOptions(sliding_window=24, logit_softcap=20.0)])
def test_backend_prefill_after_cached_context(options):
    """A chunk of 40 tokens after 56 cached ones, through the backend (keys
    written to the pool, the context gathered by block table, the kernel):
    the reference on the cached keys followed by the chunk's own."""
    block, kv_heads, heads, head_dim, cached, new = 16, 3, 9, 64, 56, 40
    g = torch.Generator().manual_seed(11)
    pool = torch.randn(2, 16 * block, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    q, k, v = (torch.randn(new, n, head_dim, generator=g).to(torch.bfloat16) for n in (heads, kv_heads, kv_heads))
    table = torch.tensor([7, 2, 9, 4, 12, 0])
    cached_slots = torch.tensor([int(table[p // block]) * block + p % block for p in range(cached)])
    slots = torch.tensor([int(table[p // block]) * block + p % block for p in range(cached, cached + new)])
    meta = AttentionMetadata(slot_mapping=slots, block_size=block)
    meta.prefills.append(PrefillSeq(0, new, cached + new, table))
    keys, values = torch.cat([pool[0, cached_slots], k]), torch.cat([pool[1, cached_slots], v])
    out = TorchPagedAttention(options).forward(q, k, v, pool, meta)
    assert_matches_reference(out, q, keys, values, head_dim**-0.5, options.sliding_window, options.logit_softcap)


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_whole_prompt_attends_to_its_keys_as_a_16_bit_pool_rounds_them(pool_dtype):
    """fp32 queries over a pool of `pool_dtype`: the prompt's last 40 rows get
    the same bits in one whole-prompt call (fresh keys, block_table None) as
    in a chunk after its first 56 tokens, which reads them back from the pool,
    so neither chunking nor a prefix-cache hit changes a row's result."""
    block, kv_heads, heads, head_dim, cached, new = 16, 3, 9, 64, 56, 40
    total = cached + new
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(total, n, head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    table = torch.tensor([7, 2, 9, 4, 12, 0])
    slots = torch.tensor([int(table[p // block]) * block + p % block for p in range(total)])
    backend = TorchPagedAttention()

    whole_meta = AttentionMetadata(slot_mapping=slots, block_size=block)
    whole_meta.prefills.append(PrefillSeq(0, total, total, None))
    whole = backend.forward(q, k, v, torch.zeros(2, 16 * block, kv_heads, head_dim, dtype=pool_dtype), whole_meta)

    pool = torch.zeros(2, 16 * block, kv_heads, head_dim, dtype=pool_dtype)
    first = AttentionMetadata(slot_mapping=slots[:cached], block_size=block)
    first.prefills.append(PrefillSeq(0, cached, cached, table[: -(-cached // block)]))
    backend.forward(q[:cached], k[:cached], v[:cached], pool, first)
    second = AttentionMetadata(slot_mapping=slots[cached:], block_size=block)
    second.prefills.append(PrefillSeq(0, new, total, table))
    chunk = backend.forward(q[cached:], k[cached:], v[cached:], pool, second)
    assert torch.equal(chunk, whole[cached:])
