"""A loaded model checkpoint: architecture, weights and where its tokenizer is.

Invariant: every Checkpoint that `loader.load_checkpoint` returns has exactly
the weights `expected_weight_shapes(arch)` names, with those shapes. Weight
names are Hugging Face Llama names whatever the file format was, so model
code has one naming scheme to know.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import LlamaArch


@dataclass
class Checkpoint:
    arch: LlamaArch
    # HF Llama names -> tensors (float32 for GGUF, as stored for safetensors;
    # the model casts to its compute dtype).
    weights: dict[str, torch.Tensor]
    # A HF model directory or a .gguf file: what `load_tokenizer` accepts.
    tokenizer_path: str
    # Human-readable origin (the path loaded), for logs and error messages.
    source: str


def expected_weight_shapes(arch: LlamaArch) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight a Llama model with `arch` needs.

    `lm_head.weight` is absent when the embeddings are tied.
    """
    h, v = arch.hidden_size, arch.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (arch.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (arch.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (arch.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, arch.q_size)
        shapes[p + "mlp.gate_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, arch.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def check_weights(arch: LlamaArch, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ModelLoadError unless `weights` matches `arch` exactly."""
    check_none_missing(arch, weights.keys(), source)
    expected = expected_weight_shapes(arch)
    extra = sorted(weights.keys() - expected.keys())
    if extra:
        raise ModelLoadError(f"{source}: unexpected weights {_preview(extra)}")
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{source}: weight {name} has shape {got}, expected {shape}")


def check_none_missing(arch: LlamaArch, names: Iterable[str], source: str) -> None:
    """Raise ModelLoadError if a weight `arch` needs is not among `names`."""
    missing = sorted(expected_weight_shapes(arch).keys() - set(names))
    if missing:
        raise ModelLoadError(f"{source}: missing weights {_preview(missing)}")


def _preview(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
