"""Writes a step's new keys and values into the paged KV pool (Triton).

One program per token stores all of its kv heads at `slot_mapping[t]`; a
negative slot (a padded row of a CUDA-graph batch) writes nothing. For an
fp8 (e4m3) pool each value is divided by its per-tensor scale and clamped to
e4m3's finite range before rounding, so a large value saturates instead of
becoming NaN.
"""
from __future__ import annotations

import torch
import triton.language as tl

from kiln.llm.kernels.triton_env import kernel, next_pow2


@kernel
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_KVH)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANT:  # 448 = the largest finite float8_e4m3fn
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0)
    dst = slot * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """k, v: [T, KVH, D] (last dim contiguous); caches: [slots, KVH, D]; slot_mapping: [T]."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_KVH=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim),
        QUANT=k_cache.dtype == torch.float8_e4m3fn,
    )
