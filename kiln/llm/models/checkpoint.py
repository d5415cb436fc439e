"""A loaded model checkpoint: architecture, weights and where its tokenizer is.

Invariant: every Checkpoint that `load_checkpoint` returns has exactly the
weights `expected_weight_shapes(arch)` names, with those shapes. Weight names
are Hugging Face Llama names whatever the file format was, so model code has
one naming scheme to know.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    expected = expected_weight_shapes(arch)
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise ModelLoadError(f"{source}: missing weights {_preview(missing)}")
    extra = sorted(weights.keys() - expected.keys())
    if extra:
        raise ModelLoadError(f"{source}: unexpected weights {_preview(extra)}")
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{source}: weight {name} has shape {got}, expected {shape}")


def _preview(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a HF Llama directory, a .gguf file, or a directory holding one .gguf."""
    # Imported here because both loaders import Checkpoint from this module.
    from kiln.llm.models.gguf_loader import load_gguf
    from kiln.llm.models.hf_loader import load_hf_dir

    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"unsupported model file {path}: expected a .gguf file or a model directory")
        ckpt = load_gguf(path)
    elif (path / "config.json").is_file():
        ckpt = load_hf_dir(path)
    else:
        ckpt = load_gguf(_single_gguf_in(path))
    check_weights(ckpt.arch, ckpt.weights, ckpt.source)
    return ckpt


def _single_gguf_in(directory: Path) -> Path:
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if not ggufs:
        raise ModelLoadError(
            f"no model found in {directory}: expected config.json with *.safetensors, or one .gguf file"
        )
    names = ", ".join(p.name for p in ggufs)
    raise ModelLoadError(f"several .gguf files in {directory} ({names}); pass the file path instead")
