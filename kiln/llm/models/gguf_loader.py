"""Load a GGUF file (llama.cpp format) into a Checkpoint.

Its `general.architecture` picks the family (kiln.llm.models.registry),
which reads the hyper-parameters and names the tensors; every tensor is
renamed to its Hugging Face name, with the converter's changes undone
(GGUFNaming). Layer projections stored as Q4_0, Q4_1 or Q4_K stay quantized
(kiln.llm.quant.formats.gguf_blocks: their codes map 1:1 onto Kiln's int4
layout); every other tensor (stacked MoE experts included) is dequantized to
float32, and the log says which types were.
Shape convention: GGUF lists dims innermost-first (`[cols, rows]`); the
reader and `gguf.quants.dequantize` hand back numpy arrays shaped
`[rows, cols]`, which is already the HF/PyTorch `[out_features, in_features]`.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.models.gguf_meta import GLOBAL_NAMES, GGUFMeta, GGUFNaming
from kiln.llm.models.registry import family_for_gguf, family_of
from kiln.llm.quant.formats.gguf_blocks import EXACT_INT4_TYPES, gguf_int4_weight
from kiln.llm.quant.formats.stored import FLOAT_ONLY, QuantizedWeight
from kiln.llm.quant.q8_0_head import Q8_0Weight, q8_0_weight

log = logging.getLogger(__name__)

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOAT_TYPES = ("F32", "F16", "BF16")
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


_reader_swap = threading.Lock()


@contextlib.contextmanager
def fast_gguf_reader() -> Iterator[None]:
    """`gguf.GGUFReader` is _FastGGUFReader inside the block, for code that
    imports it by name when called (transformers' GGUF tokenizer loading parses
    the whole header with it: seconds on a big vocabulary; see docs/benchmarks.md
    (Memory and start-up of the engine))."""
    with _reader_swap:
        stock = gguf.GGUFReader
        gguf.GGUFReader = _FastGGUFReader  # type: ignore[misc]
        try:
            yield
        finally:
            gguf.GGUFReader = stock  # type: ignore[misc]


def open_gguf(path: Path) -> GGUFReader:
    """Parse a GGUF file's header, metadata and tensor index (data stays mmapped)."""
    try:
        return _FastGGUFReader(path, "r")  # read-only: arrays viewing the file are not writeable
    except _CORRUPT_ERRORS as e:
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt): {e or type(e).__name__}") from e


@dataclass(frozen=True)
class _Piece:
    tensor: ReaderTensor
    expert: int | None = None  # index into a stacked-experts tensor


class GGUFFile:
    """A GGUF file's architecture, and its tensors under HF names,
    dequantized one at a time on request (the file stays mmapped)."""

    def __init__(self, path: Path):
        self.path = path
        reader = open_gguf(path)
        with _corrupt_as_load_error(path):
            meta = GGUFMeta(reader, path)
            reader_family = family_for_gguf(meta.arch_name, str(path))
            if reader_family.arch_from_gguf is None:  # family_for_gguf returns only families that read GGUF
                raise ModelLoadError(f"family {reader_family.name} reads no GGUF")
            self.arch = reader_family.arch_from_gguf(meta)
            family = family_of(self.arch)  # a llama GGUF with experts is Mixtral
            if family.gguf_naming is None:
                raise ModelLoadError(f"family {family.name} has no GGUF tensor names ({path})")
            self.naming = family.gguf_naming(self.arch)
            self.shapes = family.weight_map(self.arch).checkpoint_shapes()
            self._pieces = self._index(reader)
        self._stacked: tuple[str, np.ndarray] | None = None  # the last stacked-experts tensor read

    def _index(self, reader: GGUFReader) -> dict[str, _Piece]:
        pieces: dict[str, _Piece] = {}
        skipped = {f"{n}.weight" for n in self.naming.metadata_tensors}
        for t in reader.tensors:
            if t.name in skipped:
                continue
            for name, expert in _hf_names(t.name, self.naming, self.arch, self.path):
                if name not in self.shapes:
                    raise ModelLoadError(f"unexpected tensor {t.name} in {self.path}")
                pieces[name] = _Piece(t, expert)
        return pieces

    @property
    def names(self) -> list[str]:
        """HF names of the tensors in the file, in file order."""
        return list(self._pieces)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, float32, in HF layout."""
        piece = self._pieces[name]
        with _corrupt_as_load_error(self.path):
            array = self._array(piece)
        if array.shape != self.shapes[name]:
            raise ModelLoadError(
                f"tensor {piece.tensor.name} in {self.path} has shape {array.shape}, expected {self.shapes[name]}"
            )
        return torch.from_numpy(self._undo_converter(name, array))

    def _array(self, piece: _Piece) -> np.ndarray:
        if piece.expert is None:
            return _dequantize(piece.tensor, self.path)
        if self._stacked is None or self._stacked[0] != piece.tensor.name:
            self._stacked = (piece.tensor.name, _dequantize(piece.tensor, self.path))
        return np.ascontiguousarray(self._stacked[1][piece.expert])

    def _undo_converter(self, name: str, w: np.ndarray) -> np.ndarray:
        heads = self._qk_heads(name)
        if heads is not None:
            return unpermute_rows(w, heads)
        if self.naming.norm_offset and name.endswith("norm.weight"):
            return w - np.float32(self.naming.norm_offset)
        return w

    def read_quantized(self, name: str) -> QuantizedWeight | None:
        """The projection `name` in Kiln's int4 layout, straight from its
        blocks, or None if its type has no exact int4 map (see gguf_blocks)
        or it is one expert of a stacked-experts tensor (read as float)."""
        piece = self._pieces[name]
        tensor, shape = piece.tensor, self.shapes[name]
        if name in FLOAT_ONLY or len(shape) != 2 or piece.expert is not None:
            return None
        if tensor.tensor_type not in EXACT_INT4_TYPES:
            return None
        if tuple(int(d) for d in reversed(tensor.shape)) != shape:
            raise ModelLoadError(f"tensor {tensor.name} in {self.path} has shape "
                                 f"{tuple(int(d) for d in reversed(tensor.shape))}, expected {shape}")
        if tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(f"tensor {tensor.name} in {self.path} is truncated")
        with _corrupt_as_load_error(self.path):
            weight = gguf_int4_weight(tensor.data, tensor.tensor_type, *shape)
        if weight is None:
            return None
        heads = self._qk_heads(name)
        if heads is not None:
            rows = unpermute_rows(np.arange(shape[0]).reshape(-1, 1), heads)[:, 0]
            weight = weight.take_rows(torch.from_numpy(rows.copy()))
        return weight

    def read_q8_0_head(self) -> Q8_0Weight | None:
        """The LM head's Q8_0 blocks (the output tensor, or the token embedding
        of a tied head) when the file stores it as Q8_0, else None."""
        name = "lm_head.weight" if "lm_head.weight" in self._pieces else "model.embed_tokens.weight"
        piece = self._pieces.get(name)
        if piece is None or piece.expert is not None or piece.tensor.tensor_type != GGMLQuantizationType.Q8_0:
            return None
        if name != "lm_head.weight" and not self.arch.tie_word_embeddings:
            return None
        with _corrupt_as_load_error(self.path):
            return q8_0_weight(piece.tensor.data, *self.shapes[name])

    def _qk_heads(self, name: str) -> int | None:
        """The head count whose row permutation the converter applied to `name`, if any."""
        if not self.naming.permute_qk:
            return None
        if name.endswith("self_attn.q_proj.weight"):
            return self.arch.num_heads
        if name.endswith("self_attn.k_proj.weight"):
            return self.arch.num_kv_heads
        return None

    def tensor_type(self, name: str) -> str:
        return self._pieces[name].tensor.tensor_type.name


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
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    dequantized: Counter[str] = Counter()
    for name in file.names:
        weight = file.read_quantized(name)
        if weight is not None:
            quantized[name] = weight
            continue
        weights[name] = file.read(name)
        if file.tensor_type(name) not in _FLOAT_TYPES:
            dequantized[file.tensor_type(name)] += 1
    log.info(
        "%s: %d projections kept in their stored int4 blocks; dequantized to float32: %s", path, len(quantized),
        ", ".join(f"{n} {t}" for t, n in sorted(dequantized.items())) or "none",
    )
    return Checkpoint(arch=file.arch, weights=weights, tokenizer_path=str(path), source=str(path), quantized=quantized,
                      stored_head=file.read_q8_0_head())


def _hf_names(gguf_name: str, naming: GGUFNaming, arch: ModelArch, path: Path) -> list[tuple[str, int | None]]:
    """(HF name, expert index or None) of each tensor a GGUF tensor holds."""
    base, _, kind = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES and kind == "weight":
        return [(f"{GLOBAL_NAMES[base]}.weight", None)]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is not None:
        layer, block, kind = match.groups()
        prefix = f"model.layers.{layer}."
        if block in naming.block:
            return [(f"{prefix}{naming.block[block]}.{kind}", None)]
        if block in naming.experts and arch.moe is not None:
            module = naming.experts[block]
            return [(f"{prefix}{module.format(e=e)}.{kind}", e) for e in range(arch.moe.num_experts)]
    raise ModelLoadError(f"unexpected tensor {gguf_name} in {path}")


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


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert convert_hf_to_gguf.py's Q/K row permutation, which interleaves each
    head's two halves (`w.reshape(n, 2, d/2, cols).swapaxes(1, 2)`) because
    llama.cpp's rope rotates adjacent pairs where HF's rotates halves."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)
