"""Prefill / extend attention (Triton): a chunk of queries attends to its
cached prefix, read from the paged pool through its block table, and to
itself, causally, read from the step's own new keys and values.

Grid (chunks, query heads, query tiles of BLOCK_M). Chunks are ragged: each
has its own start row in the flattened batch, length and prefix length; a
program past its chunk's end returns at once. The chunk's own keys come from
the projection output rather than the pool, so an fp8 pool rounds only the
prefix (what an earlier step wrote); for a 16-bit pool under wider queries the
backend passes them rounded as the pool stores them (`as_stored`); `DOT_F32`
as in triton_decode.
"""
from __future__ import annotations

import torch
import triton.language as tl

from kiln.llm.attention.triton_decode import LOG2E
from kiln.llm.kernels.triton_env import kernel, next_pow2

BLOCK_M = 64  # queries per program
BLOCK_N = 64  # keys per tile
F32_BLOCK = 32  # both, for fp32 products (twice the registers per element; 64 compiles for ~40 s)


@kernel
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    starts_ptr, q_lens_ptr, prefix_lens_ptr, tables_ptr,
    qk_scale, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    if m_start >= q_len:
        return
    q_start = tl.load(starts_ptr + seq).to(tl.int64)
    prefix = tl.load(prefix_lens_ptr + seq).to(tl.int32)
    kvh = head // GROUP

    rows = m_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale
    if not DOT_F32:
        q = q.to(q_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)

    # The cached prefix: every query sees all of it.
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(0, prefix, BLOCK_N):
        toks = tile + offs
        tok_ok = toks < prefix
        block = tl.load(table + toks // PAGE, mask=tok_ok, other=0).to(tl.int64)
        kv_off = (block * PAGE + toks % PAGE)[:, None] * stride_cs + kvh * stride_ch + dims[None, :]
        kv_ok = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q_ptr.dtype.element_ty)))
        s = tl.where(tok_ok[None, :], s * k_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p * v_scale, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot((p * v_scale).to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # The chunk itself, causal: query row i sees chunk keys 0..i.
    for tile in range(0, tl.minimum(q_len, m_start + BLOCK_M), BLOCK_N):
        keys = tile + offs
        key_ok = keys < q_len
        kv_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + (q_start + keys)[:, None] * stride_kt + kvh * stride_kh + dims[None, :],
                    mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + (q_start + keys)[:, None] * stride_vt + kvh * stride_vh + dims[None, :],
                    mask=kv_ok, other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = key_ok[None, :] & (keys[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    q_starts: torch.Tensor, q_lens: torch.Tensor, prefix_lens: torch.Tensor, block_tables: torch.Tensor,
    max_q_len: int, block_size: int, out: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0, dot_f32: bool = False,
) -> torch.Tensor:
    """q, out: [T, H, D]; k, v: [T, KVH, D] (the step's new tokens); caches:
    [slots, KVH, D]; per chunk: q_starts (row in T), q_lens, prefix_lens
    (cached tokens before the chunk) and block_tables [S, W] (rows of
    chunks without a prefix are not read). Writes the chunks' rows of `out`."""
    num_chunks = q_starts.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    if num_chunks == 0 or max_q_len == 0:
        return out
    block_m, block_n = (F32_BLOCK, F32_BLOCK) if dot_f32 else (BLOCK_M, BLOCK_N)
    grid = (num_chunks, heads, (max_q_len + block_m - 1) // block_m)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, out, q_starts, q_lens, prefix_lens, block_tables,
        head_dim**-0.5 * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), PAGE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_f32, num_warps=8 if head_dim >= 128 else 4,
    )
    return out
