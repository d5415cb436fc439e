"""Decode attention over the paged KV pool (Triton): one query row per
sequence, GQA, split-K over long contexts.

Grid (rows, kv heads, splits). A program takes the GROUP query heads that
share one kv head (padded to BLOCK_H >= 16 rows so the score and value
products are `tl.dot`s) and one split of the row's context, reading keys and
values in tiles of BLOCK_N tokens through the block table. Each row's
context is cut into `splits(ctx) = min(max_splits, cdiv(ctx, MIN_SPLIT_TOKENS))`
pieces of whole tiles, so where a token lands depends only on its row's
context length and `max_splits`, never on the batch around it: a padded
CUDA-graph batch and the eager step give bit-identical rows. With one split
the program writes the output; with several, each writes its normalised
partial output and log-sum-exp and a second kernel merges them.

Softmax runs in base 2 (scores pre-multiplied by log2(e)). An fp8 pool holds
k / k_scale and v / v_scale: the key scale is folded into the query, the
value scale into the output. A row with context 0 (graph padding) gives 0.
`DOT_F32` makes both products fp32 (exact in Triton's interpreter, which
gets bf16 `tl.dot` wrong); on a GPU, bf16/fp16 operands go to the tensor cores.
"""
from __future__ import annotations

import math

import torch
import triton.language as tl

from kiln.llm.kernels.triton_env import kernel, next_pow2

BLOCK_N = 64  # keys per tile
MIN_SPLIT_TOKENS = 256  # a split covers at least this many tokens (rounded to tiles)
MAX_SPLITS = 16
LOG2E = 1.4426950408889634


def max_splits_for(num_rows: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per row that give about two programs per multiprocessor.

    Depends on `num_rows` only through its next power of two: every power of
    two is a captured CUDA-graph size, so a padded graph batch and the eager
    batch it stands for choose the same splits (see cuda_graphs.capture_sizes).
    """
    programs = next_pow2(num_rows) * num_kv_heads
    wanted = next_pow2(max(1, math.ceil(2 * num_sms / programs)))
    return max(1, min(MAX_SPLITS, wanted))


@kernel
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, v_scale, max_splits,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + row).to(tl.int32)
    num_splits = tl.minimum(max_splits, tl.cdiv(ctx, MIN_SPLIT))
    split_len = tl.cdiv(tl.cdiv(ctx, tl.maximum(num_splits, 1)), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)  # splits past the row's last are empty: the merge skips them

    h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + h
    head_ok = h < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale  # softmax scale, log2(e) and the fp8 key scale
    if not DOT_F32:
        q = q.to(q_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    table = tables_ptr + row.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        toks = tile + offs
        tok_ok = toks < end
        block = tl.load(table + toks // PAGE, mask=tok_ok, other=0).to(tl.int64)
        slots = block * PAGE + toks % PAGE
        kv_off = slots[:, None] * stride_cs + kvh * stride_ch + dims[None, :]
        kv_ok = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale
    o_ok = head_ok[:, None] & dim_ok[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_ok)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        base = row * stride_pt + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] + dims[None, :], o, mask=o_ok)
        tl.store(part_lse_ptr + row * stride_lt + heads * stride_lh + split, lse, mask=head_ok)


@kernel
def _merge_kernel(
    part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, max_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(lens_ptr + row).to(tl.int32)
    num_splits = tl.minimum(max_splits, tl.cdiv(ctx, MIN_SPLIT))
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * stride_lt + head * stride_lh + splits, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    parts = tl.load(part_out_ptr + row * stride_pt + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, block_size: int, max_splits: int, out: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0, dot_f32: bool = False,
) -> torch.Tensor:
    """q: [N, H, D]; caches: [slots, KVH, D]; block_tables: [N, W]; context_lens: [N].
    Writes `out` ([N, H, D], q's dtype) and returns it. `max_splits` > 1 splits
    long contexts (the partials live in fp32 scratch of N * H * max_splits * D)."""
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if rows == 0:
        return out
    group = heads // kv_heads
    qk_scale = head_dim**-0.5 * LOG2E * k_scale
    single = max_splits == 1
    part_strides: tuple[int, ...]
    if single:
        part_out = part_lse = out  # unused
        part_strides = (0, 0, 0, 0, 0)
    else:
        part_out = torch.empty(rows, heads, max_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, heads, max_splits, dtype=torch.float32, device=q.device)
        part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    _decode_kernel[(rows, kv_heads, max_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        qk_scale, v_scale, max_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), *part_strides,
        GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        PAGE=block_size, BLOCK_N=BLOCK_N, MIN_SPLIT=MIN_SPLIT_TOKENS, SINGLE_SPLIT=single, DOT_F32=dot_f32,
    )
    if not single:
        _merge_kernel[(rows, heads)](
            part_out, part_lse, context_lens, out, max_splits, *part_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_S=next_pow2(max_splits), MIN_SPLIT=MIN_SPLIT_TOKENS,
        )
    return out
