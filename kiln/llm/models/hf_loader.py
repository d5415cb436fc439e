"""Load a Hugging Face Llama model directory (config.json + *.safetensors).

Only safetensors are read: pickled `.bin` checkpoints can run code on load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import LlamaArch, RopeScaling
from kiln.llm.models.checkpoint import Checkpoint

# Architectures whose weights and forward pass are exactly Llama's.
# Mistral is Llama plus an optional sliding window (rejected below); Qwen2 has
# q/k/v biases, so it is not in this set.
_SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}
_SUPPORTED_MODEL_TYPES = {"llama", "mistral"}
_INDEX_FILE = "model.safetensors.index.json"


def load_hf_arch(directory: Path) -> LlamaArch:
    """The architecture of a HF directory, without reading its weights."""
    config_file = directory / "config.json"
    config = _read_json(config_file)
    _check_supported(config, config_file)
    return arch_from_config(config, config_file, _generation_eos_ids(directory))


def load_hf_dir(directory: Path) -> Checkpoint:
    arch = load_hf_arch(directory)
    weights = _load_safetensors(directory)
    _drop_derived_weights(weights, arch)
    return Checkpoint(arch=arch, weights=weights, tokenizer_path=str(directory), source=str(directory))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {path}: expected a JSON object")
    return data


def _check_supported(config: dict[str, Any], config_file: Path) -> None:
    archs = config.get("architectures") or []
    unsupported = [a for a in archs if a not in _SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ModelLoadError(f"unsupported architecture {unsupported[0]} in {config_file}")
    model_type = config.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"unsupported architecture (model_type {model_type!r}) in {config_file}")
    # Options that change the forward pass away from plain Llama.
    if config.get("sliding_window") is not None:
        raise ModelLoadError(f"unsupported sliding_window attention in {config_file}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ModelLoadError(f"unsupported attention/MLP biases in {config_file}")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {config['hidden_act']!r} in {config_file}")


def arch_from_config(
    config: dict[str, Any], config_file: Path, extra_eos_ids: tuple[int, ...] = ()
) -> LlamaArch:
    """Build LlamaArch from a parsed config.json (old and transformers-5 layouts)."""

    def need(key: str) -> Any:
        if config.get(key) is None:
            raise ModelLoadError(f"missing {key} in {config_file}")
        return config[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    rope = _rope_parameters(config)
    try:
        return LlamaArch(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            # Llama's default; Llama-3.2 and SmolLM configs say True explicitly.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(rope, config_file),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_unique(_as_ids(config.get("eos_token_id")) + extra_eos_ids),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid value in {config_file}: {e}") from e


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers>=5 writes `rope_parameters` (theta inside); older configs
    have `rope_theta` and `rope_scaling` at top level."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    if "rope_theta" in config and "rope_theta" not in rope:
        rope["rope_theta"] = config["rope_theta"]
    return rope


def _rope_scaling(rope: dict[str, Any], config_file: Path) -> RopeScaling | None:
    # Old configs spell the key "type".
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r} in {config_file}")
    try:
        return RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"llama3 rope_scaling lacks {e.args[0]} in {config_file}") from e


def _generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """generation_config.json often lists more stop ids than config.json
    (Llama-3 instruct: <|eot_id|>, <|eom_id|>)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return ()
    return _as_ids(_read_json(path).get("eos_token_id"))


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _unique(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def _load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(directory):
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt safetensors file {file}: {e}") from e
    return weights


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / _INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"no weight_map in {index}")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"shard {file} listed in {index} does not exist")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {directory} (pickled .bin files are not loaded)")
    return files


def _drop_derived_weights(weights: dict[str, torch.Tensor], arch: LlamaArch) -> None:
    """Remove tensors that some checkpoints store but that carry no information."""
    for name in [n for n in weights if n.endswith("rotary_emb.inv_freq")]:
        del weights[name]  # recomputed from rope_theta
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a copy of the embeddings
