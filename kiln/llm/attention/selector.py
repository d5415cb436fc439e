"""Chooses the attention backend for a device.

CUDA with Triton importable: Kiln's Triton kernels (TritonPagedAttention).
Anything else: the torch reference, with Kiln's CPU kernel for decodes.
`KILN_ATTENTION=torch` forces the reference on CUDA too (A/B runs). Triton
stays an optional import: nothing here imports it unless it is chosen.

The Triton kernels compute plain causal attention with the head_dim ** -0.5
scale; a layer that needs more (a sliding window, soft-capped scores, another
scale: Mistral, Gemma, Phi-3) takes the torch reference on CUDA, which masks
and caps (see docs/models.md (Sliding-window attention)). CUDA graphs then
stay off, as they need the Triton backend in every layer.
"""
from __future__ import annotations

import os
from typing import Any, cast

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.llm.attention.backend import AttentionBackend, TorchPagedAttention
from kiln.llm.attention.options import AttentionOptions
from kiln.llm.kernels.triton_env import triton_available


def uses_triton(device: torch.device) -> bool:
    return device.type == "cuda" and triton_available() and os.environ.get("KILN_ATTENTION", "auto") != "torch"


def select_backend(device: torch.device, options: AttentionOptions | None = None) -> AttentionBackend:
    options = options or AttentionOptions()
    if uses_triton(device) and options.is_default:
        # Imported here: Triton is an optional dependency, needed only on CUDA.
        from kiln.llm.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention()
    return TorchPagedAttention(options)


def install_attention_backend(model: nn.Module, device: torch.device, kv_cache_dtype: torch.dtype) -> None:
    """Give every attention module of `model` the backend chosen for `device`
    (one instance per layer: an fp8 pool's scales are per layer)."""
    attention = [m for m in model.modules() if isinstance(getattr(m, "backend", None), AttentionBackend)]
    if kv_cache_dtype == torch.float8_e4m3fn:
        if not uses_triton(device):
            raise ConfigError(
                "kv_cache_dtype 'fp8_e4m3' needs Kiln's Triton kernels on CUDA: install triton "
                "(pip install 'kiln[cuda]') and leave KILN_ATTENTION unset",
                param="kv_cache_dtype",
            )
        if any(not cast(Any, m).backend.options.is_default for m in attention):
            raise ConfigError(
                "kv_cache_dtype 'fp8_e4m3' is not supported for this model: its sliding-window or "
                "soft-capped attention layers run the torch reference, which reads no fp8 pool",
                param="kv_cache_dtype",
            )
    for module in attention:
        cast(Any, module).backend = select_backend(device, cast(Any, module).backend.options)
