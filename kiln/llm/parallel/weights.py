"""Read one rank's slices of a checkpoint's tensors.

`read(name, dim, start, end)` returns an owned copy of rows/columns
[start, end) along `dim`, so a rank never keeps a view into a whole tensor.
For safetensors the slice is read straight from the memory-mapped file
(`safe_open(...).get_slice`); for GGUF one tensor at a time is dequantized
and sliced (shards run float weights). Pre-quantized HF directories
(GPTQ, AWQ, FP8) are refused: their packed tensors do not slice by rows.
Either way a worker never materialises the full model: its peak
is its shard plus one whole tensor. The driver slices the Checkpoint dict it
already holds (`DictReader`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from kiln.errors import ConfigError
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.checkpoint import check_none_missing
from kiln.llm.models.gguf_loader import GGUFFile
from kiln.llm.models.hf_loader import load_hf_arch, quantization_method, safetensors_files
from kiln.llm.models.loader import locate_model


class WeightReader(Protocol):
    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor: ...


def _narrow(tensor: torch.Tensor, dim: int | None, start: int, end: int | None) -> torch.Tensor:
    if dim is None:
        return tensor
    return tensor.narrow(dim, start, (end if end is not None else tensor.shape[dim]) - start)


class DictReader:
    """Slices of an already-loaded Checkpoint's weights."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return _narrow(self.weights[name], dim, start, end).clone()


class SafetensorsReader:
    """Lazy slices from a HF directory's *.safetensors files (mmapped, per tensor)."""

    def __init__(self, directory: Path, arch: LlamaArch):
        self.where: dict[str, Any] = {}  # tensor name -> the safe_open handle of its file
        for file in safetensors_files(directory):  # the same file discovery as a full load
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                self.where[name] = handle
        check_none_missing(arch, self.where, str(directory))

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        sliced = self.where[name].get_slice(name)
        if dim is None:
            return sliced[:].clone()
        index = [slice(None)] * len(sliced.get_shape())
        index[dim] = slice(start, end)
        return sliced[tuple(index)].clone()


class GGUFWeightReader:
    """Lazy slices of a .gguf file: dequantizes only the tensor asked for."""

    def __init__(self, path: Path):
        self.file = GGUFFile(path)
        self.arch = self.file.arch
        check_none_missing(self.arch, self.file.names, str(path))

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return _narrow(self.file.read(name), dim, start, end).contiguous().clone()


def open_weights(model_path: str) -> tuple[LlamaArch, WeightReader, str]:
    """(arch, lazy reader, tokenizer path) of a HF directory (safetensors) or a GGUF file."""
    files = locate_model(model_path)
    if files.format == "hf":
        method = quantization_method(files.path)
        if method is not None:
            raise ConfigError(
                f"{files.path} is a pre-quantized checkpoint ({method}): not supported with tensor or pipeline "
                "parallelism yet; serve it with tensor_parallel_size=pipeline_parallel_size=1",
                param="tensor_parallel_size",
            )
        arch = load_hf_arch(files.path)
        return arch, SafetensorsReader(files.path, arch), str(files.path)
    reader = GGUFWeightReader(files.path)
    return reader.arch, reader, str(files.path)
