"""Kiln's Triton kernels compiled for the GPU against float64 references:
bf16 with the real bf16 `tl.dot` (which the interpreter gets wrong), fp16,
fp8 pools; Llama head sizes, long contexts with split-K; e4m3 rounding of
the KV write; the layer kernels against the torch layers."""
import pytest
import torch
import torch.nn.functional as F

from tests.unit.llm.attention.paged_reference import (
    decode_reference,
    prefill_reference,
    random_pool,
    random_tables,
)

CUDA = torch.device("cuda")
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode(dtype, head_dim, group, block_size):
    from kiln.llm.attention.triton_backend import num_sms
    from kiln.llm.attention.triton_decode import decode_attention, max_splits_for

    g = torch.Generator().manual_seed(group * block_size + head_dim)
    lens = [1, 17, 300, 1000, 4097]
    kv_heads = 2
    blocks = sum(-(-n // block_size) for n in lens) + 1
    pool = random_pool(blocks, block_size, kv_heads, head_dim, dtype, g)
    tables = random_tables(lens, block_size, blocks, g)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    ref = decode_reference(q, pool, tables, lens, block_size)
    for splits in (1, max_splits_for(len(lens), kv_heads, num_sms(CUDA))):
        out = torch.empty_like(q, device=CUDA)
        gpu_pool, lens_t = pool.to(CUDA), torch.tensor(lens, device=CUDA)
        decode_attention(q.to(CUDA), gpu_pool[0], gpu_pool[1], tables.to(CUDA), lens_t, block_size, splits, out)
        torch.testing.assert_close(out.double().cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill(dtype, group):
    from kiln.llm.attention.triton_prefill import prefill_attention

    g = torch.Generator().manual_seed(group)
    head_dim, kv_heads, block_size = 128, 2, 16
    chunks = [(300, 0), (129, 500), (1, 77), (64, 64)]
    layout, start = [], 0
    for n, prefix in chunks:
        layout.append((start, n, prefix))
        start += n
    prefixes = [p for _, p in chunks]
    blocks = sum(-(-p // block_size) for p in prefixes) + 1
    pool = random_pool(blocks, block_size, kv_heads, head_dim, dtype, g)
    tables = random_tables(prefixes, block_size, blocks, g)
    q = torch.randn(start, kv_heads * group, head_dim, generator=g).to(dtype)
    k = torch.randn(start, kv_heads, head_dim, generator=g).mul(2).to(dtype)
    v = torch.randn(start, kv_heads, head_dim, generator=g).mul(2).to(dtype)
    starts, lens, pre = (torch.tensor(c, device=CUDA) for c in zip(*layout, strict=True))
    out = torch.empty_like(q, device=CUDA)
    prefill_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), pool[0].to(CUDA), pool[1].to(CUDA), starts, lens, pre,
                      tables.to(CUDA), int(lens.max()), block_size, out)
    ref = prefill_reference(q, k, v, pool, layout, tables, block_size)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_fp8_write_rounds_like_torch_and_decode_reads_it_back():
    from kiln.llm.attention.triton_decode import decode_attention
    from kiln.llm.attention.triton_kv_write import write_kv

    g = torch.Generator(device=CUDA).manual_seed(0)
    tokens, kv_heads, head_dim, block_size, k_scale, v_scale = 2048, 8, 128, 16, 0.05, 0.02
    k = torch.randn(tokens, kv_heads, head_dim, device=CUDA, generator=g).to(torch.bfloat16) * 3
    v = torch.randn(tokens, kv_heads, head_dim, device=CUDA, generator=g).to(torch.bfloat16)
    pool = torch.zeros(2, tokens, kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=CUDA)
    slots = torch.randperm(tokens, device=CUDA, generator=g)
    write_kv(k, v, pool[0], pool[1], slots, k_scale, v_scale)
    for stored, x, scale in ((pool[0], k, k_scale), (pool[1], v, v_scale)):
        want = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(stored[slots].view(torch.uint8), want.view(torch.uint8))
    table = torch.arange(tokens // block_size).unsqueeze(0)  # the pool's blocks in order
    q = torch.randn(1, 4 * kv_heads, head_dim, device=CUDA, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    decode_attention(q, pool[0], pool[1], table.to(CUDA), torch.tensor([tokens], device=CUDA), block_size, 16, out,
                     k_scale, v_scale)
    ref = decode_reference(q.cpu(), pool.float().cpu(), table, [tokens], block_size, k_scale, v_scale)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_kernels_match_the_torch_layers(dtype):
    from kiln.llm.kernels import triton_layers
    from kiln.llm.layers.norm import reference_rms_norm
    from kiln.llm.layers.rotary import RotaryEmbedding, _rotate

    g = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(64, 4096, device=CUDA, generator=g).to(dtype)
    res = torch.randn(64, 4096, device=CUDA, generator=g).to(dtype)
    w = torch.randn(4096, device=CUDA, generator=g).to(dtype)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(triton_layers.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5),
                               rtol=2 * ulp, atol=1e-5)
    normed, total = triton_layers.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(total, x + res)
    torch.testing.assert_close(normed, reference_rms_norm(total, w, 1e-5), rtol=2 * ulp, atol=1e-5)
    gate_up = torch.randn(64, 2 * 14336, device=CUDA, generator=g).to(dtype) * 3
    gate, up = gate_up.split(14336, dim=-1)
    torch.testing.assert_close(triton_layers.silu_mul(gate_up), F.silu(gate) * up, rtol=2 * ulp, atol=1e-4)
    qkv = torch.randn(64, 48 * 128, device=CUDA, generator=g).to(dtype)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(64, 32, 128), k.view(64, 8, 128)
    rope = RotaryEmbedding(128, 4096, 500000.0, None).to(CUDA)
    cos, sin = rope.tables(torch.randint(0, 4096, (64,), device=CUDA))
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    triton_layers.rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=2 * ulp, atol=1e-3)
    torch.testing.assert_close(k, want_k, rtol=2 * ulp, atol=1e-3)
