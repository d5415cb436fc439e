"""Loads the kernel library once and exposes its ops, or None when absent.

Absent means Kiln was installed without a compiler or on a CPU without
AVX2/FMA; callers then use PyTorch's kernels (same results within float
rounding). `KILN_KERNELS=0` in the environment turns them off (A/B runs).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from kiln.llm.kernels.build import LIBRARY, cpu_supported
from kiln.llm.kernels.tuning import LINEAR_MAX_ROWS

log = logging.getLogger(__name__)


@functools.cache
def kernels_loaded() -> bool:
    if os.environ.get("KILN_KERNELS", "1") == "0":
        return False
    if not (LIBRARY.exists() and cpu_supported()):
        log.info("kiln kernels not built (%s); using PyTorch kernels", LIBRARY.name)
        return False
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as e:  # built against another torch: rebuild with `make`
        log.warning("kiln kernels not loaded (%s); using PyTorch kernels", e)
        return False
    return True


def linear_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T with Kiln's fp32 kernel, or None when it does
    not apply (library absent, not fp32 CPU, or too many rows)."""
    if (
        x.dim() != 2
        or x.shape[0] > LINEAR_MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or not weight.is_contiguous()
        or not kernels_loaded()
    ):
        return None
    return torch.ops.kiln.linear_f32(x, weight)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of an fp32 CPU weight [N, K] (an extra copy,
    the size of the weight), or None where oneDNN is unavailable."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except (AttributeError, RuntimeError):  # a torch build without the op
        return None


def linear_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ W^T with W as packed by pack_linear_weight. Each row's
    result does not depend on M (checked in tests/unit/llm/kernels)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _weight_only_applies(
    x: torch.Tensor, weight: torch.Tensor, weight_dtype: torch.dtype, params: torch.Tensor, params_dtype: torch.dtype
) -> bool:
    """fp32 CPU activations [M, K], contiguous quantized weights of the kernel's dtypes, library loaded."""
    return (
        x.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == weight_dtype
        and params.dtype == params_dtype
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and kernels_loaded()
    )


def linear_w8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] fp32 @ (weight int8 [N, K] * scales fp32 [N])^T with Kiln's
    kernel (activations stay fp32, any M), or None when it does not apply."""
    if not _weight_only_applies(x, weight, torch.int8, scales, torch.float32):
        return None
    return torch.ops.kiln.linear_w8(x, weight, scales)


def linear_w4(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """x [M, K] fp32 @ int4-group weights^T (codes uint8 [N, K/2], scale_min
    fp16 or fp32 [N, K/G, 2]; layout in linear_f32.cpp's Int4Problem) with
    Kiln's kernel (activations stay fp32, any M), or None when it does not apply."""
    params_dtype = torch.float32 if scale_min.dtype == torch.float32 else torch.float16
    if not _weight_only_applies(x, codes, torch.uint8, scale_min, params_dtype):
        return None
    return torch.ops.kiln.linear_w4(x, codes, scale_min, group_size)


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, block_size: int, scale: float | None = None, window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Decode attention read in place from the paged pool (q [B, H, D] fp32,
    pools [slots, KVH, D] fp32, fp16 or bf16) -> [B, H, D], or None when the
    kernel does not apply (library absent, not CPU, other dtypes, head_dim
    not a multiple of 16, or more than 8 query heads per kv head). `scale`
    defaults to head_dim ** -0.5; `window` > 0 reads only each row's last
    `window` keys; `softcap` soft-caps the scores."""
    heads, kv_heads, head_dim = q.shape[1], k_pool.shape[1], q.shape[2]
    if (
        q.dtype != torch.float32
        or k_pool.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or q.device.type != "cpu"
        or head_dim % 16
        or heads % kv_heads
        or heads // kv_heads > 8
        or not kernels_loaded()
    ):
        return None
    return torch.ops.kiln.paged_decode_attention(
        q, k_pool, v_pool, block_tables, context_lens, block_size, head_dim**-0.5 if scale is None else scale,
        window, softcap or 0.0,
    )


def _cuda_layers(x: torch.Tensor):
    """kiln.llm.kernels.triton_layers for a CUDA tensor (Triton installed,
    KILN_KERNELS not 0), else None."""
    if x.device.type != "cuda" or os.environ.get("KILN_KERNELS", "1") == "0":
        return None
    # Imported here: Triton is an optional dependency, needed only on CUDA.
    from kiln.llm.kernels.triton_env import triton_available

    if not triton_available():
        return None
    from kiln.llm.kernels import triton_layers

    return triton_layers


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and kernels_loaded()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x [M, K] rows in one call, or None when not fp32 CPU (or CUDA: Triton)."""
    if x.dim() == 2 and x.stride(-1) == 1 and (gpu := _cuda_layers(x)) is not None:
        return gpu.rms_norm(x, weight, eps)
    if x.dim() != 2 or not _fp32_cpu(x, weight):
        return None
    return torch.ops.kiln.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rms_norm(x + residual), x + residual) in one call, or None."""
    if x.dim() == 2 and x.stride(-1) == residual.stride(-1) == 1 and (gpu := _cuda_layers(x)) is not None:
        return gpu.add_rms_norm(x, residual, weight, eps)
    if x.dim() != 2 or not _fp32_cpu(x, residual, weight):
        return None
    return torch.ops.kiln.add_rms_norm(x, residual, weight, eps)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half RoPE on q [T, H, D] and k [T, KVH, D] in place; False
    (nothing done) when not fp32 CPU (or CUDA: Triton)."""
    if q.stride(-1) == 1 and k.stride(-1) == 1 and (gpu := _cuda_layers(q)) is not None:
        gpu.rotary_(q, k, cos, sin)
        return True
    if q.stride(-1) != 1 or k.stride(-1) != 1 or not _fp32_cpu(q, k, cos, sin):
        return False
    torch.ops.kiln.rotary_(q, k, cos, sin)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2I] = gate | up, or None."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and (gpu := _cuda_layers(gate_up)) is not None:
        return gpu.silu_mul(gate_up)
    if gate_up.dim() != 2 or not _fp32_cpu(gate_up):
        return None
    return torch.ops.kiln.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up for gate_up [T, 2I] = gate | up (fp32 CPU), or None."""
    if gate_up.dim() != 2 or not _fp32_cpu(gate_up):
        return None
    return torch.ops.kiln.gelu_tanh_mul(gate_up)
