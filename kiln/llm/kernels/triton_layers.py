"""Kiln's fused layer kernels for CUDA tensors (Triton): RMSNorm, residual
add + RMSNorm, rotary embedding in place, SiLU-and-multiply.

Each does in one launch what the torch reference (layers/norm.py,
layers/rotary.py, models/llama.py) does in several, with the same roundings:
normalise in fp32 and round to the activation dtype before the weight
multiply; the residual sum rounded before it is normalised; SiLU rounded
before the multiply. kernels/ops.py sends CUDA tensors here.
"""
from __future__ import annotations

import torch
import triton.language as tl

from kiln.llm.kernels.triton_env import kernel, next_pow2


@kernel
def _rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, eps, K, stride_x, stride_r, stride_s, stride_o,
                     BLOCK_K: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = w * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, K] -> [M, K] in x's dtype."""
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x, x, weight, out, eps, x.shape[1], x.stride(0), 0, 0, out.stride(0),
                                        BLOCK_K=next_pow2(x.shape[1]), ADD=False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
    out, total = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, total, weight, out, eps, x.shape[1], x.stride(0),
                                        residual.stride(0), total.stride(0), out.stride(0),
                                        BLOCK_K=next_pow2(x.shape[1]), ADD=True)
    return out, total


@kernel
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    ok = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    cos = tl.load(cos_ptr + t * stride_ct + cols, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_ct + cols, mask=cols < HALF, other=0.0)[None, :]
    first = x_ptr + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=ok)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place: q [T, H, D], k [T, KVH, D] (last dim
    contiguous); cos, sin [T, 1, D/2] fp32."""
    tokens, _, head_dim = q.shape
    if tokens == 0:
        return
    half = head_dim // 2
    cos, sin = cos.reshape(tokens, half), sin.reshape(tokens, half)
    for x in (q, k):
        _rotary_kernel[(tokens,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), x.shape[1],
                                  HALF=half, BLOCK_H=next_pow2(x.shape[1]), BLOCK_HALF=next_pow2(half))


@kernel
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gu_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_g + inter + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] = gate | up -> silu(gate) * up [T, I]."""
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(1024, next_pow2(inter))
        _silu_mul_kernel[(tokens, -(-inter // block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                       BLOCK=block)
    return out
