"""Parallel layers: each holds only its rank's shard and loads it itself.

The linears stay `Linear` subclasses whose forward is a plain local matmul:
- ColumnParallelLinear keeps some output rows of W (a fused projection keeps
  a row range of each of its parts: q|k|v, gate|up); its output stays split.
- RowParallelLinear keeps the matching input columns; its partial outputs
  are summed by ONE all-reduce, which the caller issues (`state.all_reduce`)
  rather than the layer. Keeping the reduction out of the module means a
  per-module transform applied after loading (weight-only quantization swaps
  each `Linear` for a quantized one built from its weight) quantizes the
  shard and leaves the communication where it is.
The embedding and LM head split the vocabulary into equal padded shards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.llm.layers.linear import Linear
from kiln.llm.parallel.state import ParallelState
from kiln.llm.parallel.weights import WeightReader

Range = tuple[int, int]


def _check(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"weight {name} slice has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")


class ColumnParallelLinear(Linear):
    """Output features split: this rank keeps rows `ranges[i]` of part i."""

    def __init__(self, in_features: int, ranges: list[Range]):
        super().__init__(in_features, sum(hi - lo for lo, hi in ranges))
        self.ranges = ranges

    def load(self, reader: WeightReader, names: list[str]) -> None:
        parts = [reader.read(n, 0, lo, hi) for n, (lo, hi) in zip(names, self.ranges, strict=False)]
        fused = torch.cat(parts) if len(parts) > 1 else parts[0]
        _check(self.weight, fused, "+".join(names))
        self.weight.data.copy_(fused)


class RowParallelLinear(Linear):
    """Input features split: this rank keeps columns `cols` of W. Its output
    is a partial sum; the caller all-reduces it."""

    def __init__(self, cols: Range, out_features: int):
        super().__init__(cols[1] - cols[0], out_features)
        self.cols = cols

    def load(self, reader: WeightReader, name: str) -> None:
        shard = reader.read(name, 1, *self.cols)
        _check(self.weight, shard, name)
        self.weight.data.copy_(shard)


def read_vocab_rows(reader: WeightReader, name: str, rows: Range, vocab_size: int) -> torch.Tensor:
    """Rows [lo, hi) of a [vocab, hidden] tensor, zero-padded past vocab_size."""
    lo, hi = rows
    real = reader.read(name, 0, lo, min(hi, vocab_size)) if lo < vocab_size else None
    if real is not None and real.shape[0] == hi - lo:
        return real
    hidden = real.shape[1] if real is not None else reader.read(name, 0, 0, 1).shape[1]
    padded = torch.zeros(hi - lo, hidden, dtype=real.dtype if real is not None else torch.float32)
    if real is not None:
        padded[: real.shape[0]] = real
    return padded


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding; ids outside give zeros, summed over TP."""

    def __init__(self, rows: Range, vocab_size: int, hidden: int, state: ParallelState):
        super().__init__()
        self.rows, self.vocab_size, self.state = rows, vocab_size, state
        self.weight = nn.Parameter(torch.empty(rows[1] - rows[0], hidden), requires_grad=False)

    def load(self, reader: WeightReader, name: str) -> None:
        shard = read_vocab_rows(reader, name, self.rows, self.vocab_size)
        _check(self.weight, shard, name)
        self.weight.data.copy_(shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.embedding(ids, self.weight)
        lo, hi = self.rows
        outside = (ids < lo) | (ids >= hi)
        x = F.embedding((ids - lo).masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.state.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Rows [lo, hi) of the LM head (shared with the embedding when tied and
    on the same rank). `forward` gives this rank's logit columns; the stage
    gathers them (`ParallelState.gather_vocab`)."""

    def __init__(self, rows: Range, vocab_size: int, hidden: int, tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.rows, self.vocab_size = rows, vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows[1] - rows[0], hidden), requires_grad=False)
        self.tied = tied_to is not None

    def load(self, reader: WeightReader, name: str) -> None:
        if self.tied:
            return
        shard = read_vocab_rows(reader, name, self.rows, self.vocab_size)
        _check(self.weight, shard, name)
        self.weight.data.copy_(shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
