"""Chooses the attention backend for a device.

CUDA with Triton importable: Kiln's Triton kernels (TritonPagedAttention).
Anything else: the torch reference, with Kiln's CPU kernel for decodes.
`KILN_ATTENTION=torch` forces the reference on CUDA too (A/B runs). Triton
stays an optional import: nothing here imports it unless it is chosen.
"""
from __future__ import annotations

import os
from typing import Any, cast

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.llm.attention.backend import AttentionBackend, TorchPagedAttention
from kiln.llm.kernels.triton_env import triton_available


def uses_triton(device: torch.device) -> bool:
    return device.type == "cuda" and triton_available() and os.environ.get("KILN_ATTENTION", "auto") != "torch"


def select_backend(device: torch.device) -> AttentionBackend:
    if uses_triton(device):
        from kiln.llm.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention()
    return TorchPagedAttention()


def install_attention_backend(model: nn.Module, device: torch.device, kv_cache_dtype: torch.dtype) -> None:
    """Give every attention module of `model` the backend chosen for `device`
    (one instance per layer: an fp8 pool's scales are per layer)."""
    if kv_cache_dtype == torch.float8_e4m3fn and not uses_triton(device):
        raise ConfigError(
            "kv_cache_dtype 'fp8_e4m3' needs Kiln's Triton kernels on CUDA: install triton "
            "(pip install 'kiln[cuda]') and leave KILN_ATTENTION unset",
            param="kv_cache_dtype",
        )
    for module in model.modules():
        if isinstance(getattr(module, "backend", None), AttentionBackend):
            cast(Any, module).backend = select_backend(device)
