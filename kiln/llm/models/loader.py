"""Find a model's files and load them into a Checkpoint, whatever the format.

A model path is a Hugging Face directory (config.json + *.safetensors), a
.gguf file, or a directory holding exactly one .gguf file. `locate_model`
decides which; full loads (`load_checkpoint`) and the lazy per-rank readers
of tensor parallelism (kiln.llm.parallel.weights) share that decision.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.checkpoint import Checkpoint, check_weights
from kiln.llm.models.gguf_loader import GGUFFile, load_gguf
from kiln.llm.models.hf_loader import load_hf_arch, load_hf_dir


@dataclass(frozen=True)
class ModelFiles:
    format: Literal["hf", "gguf"]
    path: Path  # the HF directory, or the .gguf file


def locate_model(path: str | Path) -> ModelFiles:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"unsupported model file {path}: expected a .gguf file or a model directory")
        return ModelFiles("gguf", path)
    if (path / "config.json").is_file():
        return ModelFiles("hf", path)
    return ModelFiles("gguf", single_gguf_in(path))


def single_gguf_in(directory: Path) -> Path:
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if not ggufs:
        raise ModelLoadError(
            f"no model found in {directory}: expected config.json with *.safetensors, or one .gguf file"
        )
    names = ", ".join(p.name for p in ggufs)
    raise ModelLoadError(f"several .gguf files in {directory} ({names}); pass the file path instead")


def read_arch(path: str | Path) -> ModelArch:
    """A model path's arch from its metadata alone (config.json, or the GGUF
    header): an unsupported architecture fails here, before any weight is read."""
    files = locate_model(path)
    return load_hf_arch(files.path) if files.format == "hf" else GGUFFile(files.path).arch


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a HF Llama directory, a .gguf file, or a directory holding one .gguf."""
    files = locate_model(path)
    ckpt = load_hf_dir(files.path) if files.format == "hf" else load_gguf(files.path)
    check_weights(ckpt.arch, {**ckpt.weights, **ckpt.quantized}, ckpt.source)
    return ckpt
