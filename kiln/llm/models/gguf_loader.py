"""Load a llama-architecture GGUF file (llama.cpp format) into a Checkpoint.

Every tensor is dequantized to float32 and renamed to its Hugging Face name.
Shape convention: GGUF lists dims innermost-first (`[cols, rows]`); the
reader and `gguf.quants.dequantize` hand back numpy arrays shaped
`[rows, cols]`, which is already the HF/PyTorch `[out_features, in_features]`.
"""
from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.checkpoint import Checkpoint, expected_weight_shapes

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when tied to the embeddings
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_REQUIRED = object()
# What a truncated or corrupt file makes the gguf reader raise.
_CORRUPT_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError)


class _FastGGUFReader(GGUFReader):
    """GGUFReader that slices a plain ndarray view of its np.memmap.

    Same parse, much faster on files with a big vocabulary: slicing the
    np.memmap subclass is slow per slice, and the reader slices once per
    token and merge (see docs/benchmarks.md (GGUF header parse (model loading))). Overrides
    the reader's private `_get` (same signature as gguf 0.10-0.19).
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        if order == "I" or (order == "<" and sys.byteorder == "little"):
            return arr  # already native order: skip a second view
        return arr.view(arr.dtype.newbyteorder(order))


def open_gguf(path: Path) -> GGUFReader:
    """Parse a GGUF file's header, metadata and tensor index (data stays mmapped)."""
    try:
        return _FastGGUFReader(path, "r")  # read-only: arrays viewing the file are not writeable
    except _CORRUPT_ERRORS as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e or type(e).__name__}") from e


class GGUFFile:
    """A llama GGUF file's architecture, and its tensors under HF names,
    dequantized one at a time on request (the file stays mmapped)."""

    def __init__(self, path: Path):
        self.path = path
        reader = open_gguf(path)
        with _corrupt_as_load_error(path):
            self.arch = _read_arch(reader, path)
            self.shapes = expected_weight_shapes(self.arch)
            self._tensors = {_hf_name(t.name, path): t for t in reader.tensors}
        unexpected = [t.name for name, t in self._tensors.items() if name not in self.shapes]
        if unexpected:
            raise ModelLoadError(f"unexpected tensor {unexpected[0]} in {path}")

    @property
    def names(self) -> list[str]:
        """HF names of the tensors in the file, in file order."""
        return list(self._tensors)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, float32, in HF layout."""
        tensor = self._tensors[name]
        with _corrupt_as_load_error(self.path):
            array = _dequantize(tensor, self.path)
        if array.shape != self.shapes[name]:
            raise ModelLoadError(
                f"tensor {tensor.name} in {self.path} has shape {array.shape}, expected {self.shapes[name]}"
            )
        return torch.from_numpy(_unpermute_if_qk(name, array, self.arch))


@contextlib.contextmanager
def _corrupt_as_load_error(path: Path) -> Iterator[None]:
    try:
        yield
    except ModelLoadError:
        raise
    except _CORRUPT_ERRORS as e:
        raise ModelLoadError(f"corrupt GGUF file {path}: {e or type(e).__name__}") from e


def load_gguf(path: Path) -> Checkpoint:
    file = GGUFFile(path)
    weights = {name: file.read(name) for name in file.names}
    return Checkpoint(arch=file.arch, weights=weights, tokenizer_path=str(path), source=str(path))


def _meta(reader: GGUFReader, key: str, path: Path, default: Any = _REQUIRED) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"missing metadata {key} in GGUF file {path}")
        return default
    return field.contents()


def _read_arch(reader: GGUFReader, path: Path) -> LlamaArch:
    name = _meta(reader, "general.architecture", path)
    if name != "llama":
        raise ModelLoadError(f"unsupported GGUF architecture {name!r} in {path}: only 'llama' is supported")
    _check_rope_supported(reader, path)
    hidden = int(_meta(reader, "llama.embedding_length", path))
    heads = int(_meta(reader, "llama.attention.head_count", path))
    head_dim = int(_meta(reader, "llama.attention.key_length", path, hidden // heads))
    rope_dim = int(_meta(reader, "llama.rope.dimension_count", path, head_dim))
    if rope_dim != head_dim:  # partial rotary embedding: not plain Llama
        raise ModelLoadError(f"unsupported rope.dimension_count {rope_dim} != head_dim {head_dim} in {path}")
    return LlamaArch(
        vocab_size=_vocab_size(reader, path),
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, "llama.feed_forward_length", path)),
        num_layers=int(_meta(reader, "llama.block_count", path)),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, "llama.attention.head_count_kv", path, heads)),
        head_dim=head_dim,
        # Stored as float32; float() keeps that exact value (as transformers does).
        rms_norm_eps=float(_meta(reader, "llama.attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(_meta(reader, "llama.rope.freq_base", path, 10000.0)),
        max_position_embeddings=int(_meta(reader, "llama.context_length", path)),
        tie_word_embeddings=not _has_tensor(reader, "output.weight"),
        rope_scaling=None,
        bos_token_id=_optional_int(_meta(reader, "tokenizer.ggml.bos_token_id", path, None)),
        eos_token_ids=_eos_ids(reader, path),
    )


def _check_rope_supported(reader: GGUFReader, path: Path) -> None:
    scaling = _meta(reader, "llama.rope.scaling.type", path, "none")
    if scaling != "none":
        raise ModelLoadError(f"unsupported rope scaling type {scaling!r} in {path}")
    # llama.cpp stores Llama-3.1 style scaling as per-frequency factors, which
    # LlamaArch cannot express (it wants the four RopeScaling parameters).
    if _has_tensor(reader, "rope_freqs.weight"):
        raise ModelLoadError(f"unsupported rope_freqs tensor (llama3 rope scaling) in {path}")


def _has_tensor(reader: GGUFReader, name: str) -> bool:
    return any(t.name == name for t in reader.tensors)


def _vocab_size(reader: GGUFReader, path: Path) -> int:
    size = _meta(reader, "llama.vocab_size", path, None)
    if size is not None:
        return int(size)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"no llama.vocab_size or tokenizer.ggml.tokens in {path}")
    return len(tokens.data)  # one data index per token; avoids decoding the strings


def _eos_ids(reader: GGUFReader, path: Path) -> tuple[int, ...]:
    # end-of-turn is a stop token too (Llama-3 GGUFs set both).
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [_optional_int(_meta(reader, k, path, None)) for k in keys]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ModelLoadError(f"unexpected tensor {gguf_name} in {path}")
    layer, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.weight"


def _dequantize(tensor: ReaderTensor, path: Path) -> np.ndarray:
    if tensor.data.nbytes != tensor.n_bytes:
        raise ModelLoadError(f"tensor {tensor.name} in {path} is truncated")
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"unsupported tensor type {tensor.tensor_type.name} for {tensor.name} in {path}"
        ) from e
    # F32 tensors come back as read-only views of the mmapped file; torch
    # needs writeable memory that outlives the reader, so copy those.
    if array.dtype != np.float32 or not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32, order="C")
    return array


def _unpermute_if_qk(name: str, w: np.ndarray, arch: LlamaArch) -> np.ndarray:
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute_rows(w, arch.num_heads)
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute_rows(w, arch.num_kv_heads)
    return w


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert convert_hf_to_gguf.py's Q/K row permutation, which interleaves each
    head's two halves (`w.reshape(n, 2, d/2, cols).swapaxes(1, 2)`) because
    llama.cpp's rope rotates adjacent pairs where HF's rotates halves."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)
