"""Load a Hugging Face model directory (config.json + *.safetensors).

config.json's `architectures` picks the family (kiln.llm.models.registry),
which reads the hyper-parameters. Only safetensors are read: pickled `.bin`
checkpoints can run code on load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.models.hf_config import as_ids
from kiln.llm.models.registry import expected_weight_shapes, family_for_hf
from kiln.llm.quant.formats.hf import quant_method, split_prequantized

_INDEX_FILE = "model.safetensors.index.json"


def load_hf_arch(directory: Path) -> ModelArch:
    """The architecture of a HF directory, without reading its weights."""
    config_file = directory / "config.json"
    return arch_from_config(_read_json(config_file), config_file, generation_eos_ids(directory))


def quantization_method(directory: Path) -> str | None:
    """`quantization_config.quant_method` of a HF directory (None: a float checkpoint)."""
    return quant_method(_read_json(directory / "config.json"))


def load_hf_dir(directory: Path) -> Checkpoint:
    arch = load_hf_arch(directory)
    weights, quantized = split_prequantized(
        _load_safetensors(directory), _read_json(directory / "config.json"), str(directory),
        expected_weight_shapes(arch).keys(),
    )
    _drop_derived_weights(weights, arch)
    return Checkpoint(
        arch=arch, weights=weights, tokenizer_path=str(directory), source=str(directory), quantized=quantized
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot read {path}: expected a JSON object")
    return data


def arch_from_config(
    config: dict[str, Any], config_file: Path, extra_eos_ids: tuple[int, ...] = ()
) -> ModelArch:
    """The ModelArch a parsed config.json describes, read by its family."""
    family = family_for_hf(list(config.get("architectures") or []), str(config_file))
    try:
        return family.arch_from_hf(config, str(config_file), extra_eos_ids)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"invalid value in {config_file}: {e}") from e


def generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """generation_config.json often lists more stop ids than config.json
    (Llama-3 instruct: <|eot_id|>, <|eom_id|>)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return ()
    return as_ids(_read_json(path).get("eos_token_id"))


def _load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    found_in: dict[str, Path] = {}
    for file in safetensors_files(directory):
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt safetensors file {file}: {e}") from e
        twice = sorted(tensors.keys() & weights.keys())
        if twice:  # the later file would win in silence (e.g. two checkpoints' shards in one directory)
            raise ModelLoadError(f"tensor {twice[0]} is stored in both {found_in[twice[0]].name} and {file.name} "
                                 f"in {directory}")
        weights.update(tensors)
        found_in.update(dict.fromkeys(tensors, file))
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


def _drop_derived_weights(weights: dict[str, torch.Tensor], arch: ModelArch) -> None:
    """Remove tensors that some checkpoints store but that carry no information."""
    for name in [n for n in weights if n.endswith("rotary_emb.inv_freq")]:
        del weights[name]  # recomputed from rope_theta
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a copy of the embeddings
