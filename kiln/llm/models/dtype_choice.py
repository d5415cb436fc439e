"""What `--dtype auto` (the default) means for one engine, decided once at load.

On CPU: bfloat16 where the CPU has native bf16 dot products (AVX512_BF16,
or AMX, which comes with it) and Kiln's `avx512_bf16` kernel build is loaded
(its decode kernels, paged attention and fused layer run bf16); float32
everywhere else (AVX2-only CPUs, `KILN_ISA=avx2`, `KILN_KERNELS=0`, no
compiler), where bf16 would only add conversions. On CUDA: the checkpoint's
own dtype. An explicit dtype is always honoured. The KV pool's `auto` follows
the model's dtype, but for a GGUF file in float32 on CPU (choose_kv_dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.kernels import isa, ops

AUTO = "auto"
TORCH_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # one of kiln.config.DTYPES, never "auto"
    reason: str  # for the start-up log line


def choose_dtype(requested: str, device: str, checkpoint_dtype: torch.dtype | None) -> DtypeChoice:
    """The model dtype for `requested` (a config dtype, maybe "auto") on `device`."""
    if requested != AUTO:
        return DtypeChoice(requested, "set by --dtype")
    if device.startswith("cuda"):
        name = TORCH_NAMES.get(checkpoint_dtype) if checkpoint_dtype is not None else None
        if name is None:
            return DtypeChoice("float32", "auto on CUDA: the checkpoint's dtype is not known here")
        return DtypeChoice(name, "auto on CUDA: the checkpoint's dtype")
    return cpu_auto(isa.cpu_isa(), ops.loaded_library())


def cpu_auto(choice: isa.IsaChoice, library: str | None) -> DtypeChoice:
    """bfloat16 when the ISA level in use has bf16 dot products and the bf16
    kernel build is the one loaded; float32 otherwise."""
    if isa.preferred_cpu_dtype_for(choice) != "bfloat16":
        return DtypeChoice("float32", f"auto: CPU ISA level {choice.level} has no AVX512_BF16 or AMX")
    if library != "avx512_bf16":
        return DtypeChoice(
            "float32", f"auto: CPU ISA level {choice.level}, but Kiln's avx512_bf16 kernels are not loaded "
            f"(loaded: {library or 'none'})",
        )
    return DtypeChoice("bfloat16", f"auto: CPU ISA level {choice.level} with Kiln's avx512_bf16 kernels")


def choose_kv_dtype(requested: str, model_dtype: str, device: str, gguf: bool) -> DtypeChoice:
    """The KV pool's dtype for `requested` (cache.kv_cache_dtype, maybe "auto")
    once the model's is decided. `auto` is the model's dtype, but float16 for
    a GGUF checkpoint computed in float32 on a CPU: llama.cpp's default cache
    for the same file, and half the bytes a decode step's attention reads
    (a 64-row step of SmolLM2's default load 1.12x faster, Zen 3,
    docs/benchmarks.md); the keys and values are rounded once, as written."""
    if requested != AUTO:
        return DtypeChoice(requested, "set by --kv-cache-dtype")
    if gguf and model_dtype == "float32" and not device.startswith("cuda"):
        return DtypeChoice("float16", "auto: a GGUF checkpoint in float32 on CPU, as llama.cpp's default cache")
    return DtypeChoice(model_dtype, "auto: the model's dtype")


def checkpoint_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype the checkpoint stores its embeddings in (None: weights not loaded here)."""
    embed = weights.get("model.embed_tokens.weight")
    return None if embed is None else embed.dtype
