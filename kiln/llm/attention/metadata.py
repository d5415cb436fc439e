"""Per-step attention inputs, built once by the runner and shared by all layers.

Token layout of a step's flattened batch (no padding between sequences):

    [ d0 d1 d1 d1 ... | p0 p0 p0 ... | p1 p1 ... ]
      decode rows:      prefill chunks, each a contiguous run
      one per token of
      a short chunk

`slot_mapping[t]` is the flat KV-pool slot (block_id * block_size + offset)
where token t's key/value are written before attention reads the pool.
Contexts are read from the pool a whole block at a time: `block_tables`
rows list a sequence's blocks (padded with block 0), and positions past a
sequence's length are masked out. A decode row is one query token with its
own context length (a verification chunk of 1 + k tokens gives k + 1 rows
sharing one block table). Decode chunks are sorted by context length and
their rows split into groups, so padding stays small.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    q_start: int  # first row of this chunk in the flattened batch
    q_len: int
    ctx_len: int  # tokens visible to the chunk's last query (cached + chunk)
    block_table: torch.Tensor | None  # [ceil(ctx_len / bs)] long; None if the chunk is the whole context


@dataclass
class DecodeGroup:
    """Decode rows [first_row, first_row + num_seqs), attended as one padded batch
    (one row per query token; rows of one chunk share its block table)."""

    first_row: int
    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [num_seqs] long, tokens each row attends to
    block_size: int

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[num_seqs, 1, 1, max_blocks * bs] bool, True = attend: for the padded
        torch path only, so built on its first use (kernels that read each row's
        context exactly never ask; it was 40% of a one-row step's input
        building, ~27 us)."""
        span = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.block_tables.device)
        return (span.unsqueeze(0) < self.context_lens.unsqueeze(1))[:, None, None, :]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    block_size: int
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
    # A backend's own per-step tensors (e.g. the Triton kernels' flat tables),
    # built by its first layer and reused by the others; None until then.
    kernel_plan: object | None = None

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decode row's block table (padded with block 0 to the widest group's)
        and context length, in row order (at least one group): for kernels that
        read each row's context exactly, to which padding costs nothing."""
        groups = self.decode_groups
        if len(groups) == 1:
            return groups[0].block_tables, groups[0].context_lens
        width = max(g.block_tables.shape[1] for g in groups)
        tables = torch.cat([F.pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups])
        return tables, torch.cat([g.context_lens for g in groups])
