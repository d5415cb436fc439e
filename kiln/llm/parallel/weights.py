"""Read one rank's slices of a checkpoint's tensors.

`read(name, dim, start, end)` returns an owned copy of rows/columns
[start, end) along `dim`, so a rank never keeps a view into a whole tensor.
For safetensors the slice is read straight from the memory-mapped file
(`safe_open(...).get_slice`); for GGUF one tensor at a time is dequantized
and sliced. Either way a worker never materialises the full model: its peak
is its shard plus one whole tensor. The driver slices the Checkpoint dict it
already holds (`DictReader`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.checkpoint import expected_weight_shapes


class WeightReader(Protocol):
    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor: ...


class DictReader:
    """Slices of an already-loaded Checkpoint's weights."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    def read(self, name, dim=None, start=0, end=None):
        tensor = self.weights[name]
        if dim is not None:
            tensor = tensor.narrow(dim, start, (end if end is not None else tensor.shape[dim]) - start)
        return tensor.clone()


class SafetensorsReader:
    """Lazy slices from a HF directory's *.safetensors files (mmapped, per tensor)."""

    def __init__(self, directory: Path, arch: LlamaArch):
        from safetensors import safe_open

        from kiln.llm.models.hf_loader import _safetensors_files  # the same file discovery as a full load

        self.files = {}
        self.where: dict[str, object] = {}
        for file in _safetensors_files(directory):
            handle = safe_open(str(file), framework="pt")
            self.files[file] = handle
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                self.where[name] = handle
        self.tied = arch.tie_word_embeddings
        missing = sorted(expected_weight_shapes(arch).keys() - self.where.keys())
        if missing:
            raise ModelLoadError(f"{directory}: missing weights {missing[:5]}")

    def read(self, name, dim=None, start=0, end=None):
        sliced = self.where[name].get_slice(name)
        if dim is None:
            return sliced[:].clone()
        index = [slice(None)] * len(sliced.get_shape())
        index[dim] = slice(start, end)
        return sliced[tuple(index)].clone()


class GGUFWeightReader:
    """Lazy slices of a .gguf file: dequantizes only the tensor asked for."""

    def __init__(self, path: Path):
        from kiln.llm.models import gguf_loader as g

        self.g, self.path = g, path
        reader = g.open_gguf(path)
        try:
            self.arch = g._read_arch(reader, path)
            self.tensors = {g._hf_name(t.name, path): t for t in reader.tensors}
        except g._CORRUPT_ERRORS as e:
            raise ModelLoadError(f"corrupt GGUF file {path}: {e or type(e).__name__}") from e
        self.shapes = expected_weight_shapes(self.arch)
        missing = sorted(self.shapes.keys() - self.tensors.keys())
        if missing:
            raise ModelLoadError(f"{path}: missing weights {missing[:5]}")

    def read(self, name, dim=None, start=0, end=None):
        array = self.g._dequantize(self.tensors[name], self.path)
        if array.shape != self.shapes[name]:
            raise ModelLoadError(f"tensor {name} in {self.path} has shape {array.shape}, expected {self.shapes[name]}")
        tensor = torch.from_numpy(self.g._unpermute_if_qk(name, array, self.arch))
        if dim is not None:
            tensor = tensor.narrow(dim, start, (end if end is not None else tensor.shape[dim]) - start)
        return tensor.contiguous().clone()


def open_weights(model_path: str) -> tuple[LlamaArch, WeightReader, str]:
    """(arch, lazy reader, tokenizer path) of a HF directory (safetensors) or a GGUF file."""
    from kiln.llm.models.checkpoint import _single_gguf_in
    from kiln.llm.models.hf_loader import load_hf_arch

    path = Path(model_path)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir() and (path / "config.json").is_file():
        arch = load_hf_arch(path)
        return arch, SafetensorsReader(path, arch), str(path)
    gguf = path if path.is_file() else _single_gguf_in(path)
    if gguf.suffix != ".gguf":
        raise ModelLoadError(f"unsupported model file {gguf}: expected a .gguf file or a model directory")
    reader = GGUFWeightReader(gguf)
    return reader.arch, reader, str(gguf)
