"""Flattens a step's scheduled chunks into model inputs (no padding)."""
from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from kiln.llm.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSeq
from kiln.llm.kernels.tuning import DECODE_GROUP_SIZE, MAX_DECODE_LIKE_TOKENS
from kiln.llm.kv_cache.manager import cdiv


class FedChunk(Protocol):
    """What build_inputs reads of a chunk: a ScheduledChunk (one process), or
    the PlanChunk a parallel driver sends every rank (no Request inside)."""

    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def draft_token_ids(self) -> list[int]: ...
    @property
    def sample(self) -> bool: ...
    @property
    def feeds_prompt(self) -> bool: ...
    def token_ids(self) -> list[int]: ...


Chunk = TypeVar("Chunk", bound=FedChunk)


@dataclass
class ModelInputs(Generic[Chunk]):
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states to compute logits for
    sample_chunks: list[Chunk]  # same order as sample_rows
    # Speculative chunks own 1 + drafts consecutive sample rows (their last
    # positions); False means one row per sample chunk.
    has_spec: bool = False
    # Every chunk with the first row of its tokens (row order), for outputs over whole chunks.
    chunk_rows: list[tuple[Chunk, int]] = field(default_factory=list)

    @property
    def samples_every_row(self) -> bool:
        """sample_rows is every row in order (a step of decodes and verifications):
        the hidden states need no gather. Rows are sampled in increasing order, so
        as many sample rows as rows means all of them."""
        return self.sample_rows.shape[0] == self.input_ids.shape[0]


def is_decode_like(c: FedChunk) -> bool:
    """A chunk of few generated tokens on cached context (a decode, a
    speculative verification) is attended row by row: every row is one query
    with its own context length, so it batches with the decodes instead of
    costing one attention call per sequence. A prompt's rows are always
    attended as a prefill, its tail after a prefix-cache hit or chunking
    included: the prefill kernel gives a row the same bits whatever the chunk
    (the decode kernel sums a score's products in another order), so a
    repeated prompt computes what it computed the first time."""
    return c.start > 0 and not c.feeds_prompt and c.num_tokens <= MAX_DECODE_LIKE_TOKENS



def build_inputs(chunks: Sequence[Chunk], block_size: int, device: torch.device) -> ModelInputs[Chunk]:
    decodes = sorted((c for c in chunks if is_decode_like(c)), key=lambda c: c.start)
    prefills = [c for c in chunks if not is_decode_like(c)]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_chunks: list[Chunk] = []
    has_spec = False
    chunk_rows: list[tuple[Chunk, int]] = []
    for c in decodes + prefills:
        chunk_rows.append((c, len(ids)))
        end = c.start + c.num_tokens
        ids.extend(c.token_ids())
        positions.extend(range(c.start, end))
        slots.extend(c.block_ids[p // block_size] * block_size + p % block_size for p in range(c.start, end))
        if c.sample:
            if c.draft_token_ids:
                has_spec = True
                sample_rows.extend(range(len(ids) - 1 - len(c.draft_token_ids), len(ids)))
            else:
                sample_rows.append(len(ids) - 1)
            sample_chunks.append(c)

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return long_tensor(values, device)

    # (block ids, context length) per decode row, in row order.
    rows = [(c.block_ids, c.start + i + 1) for c in decodes for i in range(c.num_tokens)]
    meta = AttentionMetadata(slot_mapping=tensor(slots), block_size=block_size, num_decodes=len(rows))
    # Decode rows (sorted by context) are attended in groups, each padded only
    # to its own longest context (the torch path pads; Kiln's CPU kernel reads
    # exactly each row's context): one padded batch over 1..600-token contexts
    # would gather and score about twice the keys it needs.
    for first in range(0, len(rows), DECODE_GROUP_SIZE):
        group = rows[first : first + DECODE_GROUP_SIZE]
        meta.decode_groups.append(decode_group(first, group, block_size, tensor))
    row = len(rows)
    for c in prefills:
        ctx_len = c.start + c.num_tokens
        table = None if c.start == 0 else tensor(c.block_ids[: cdiv(ctx_len, block_size)])
        meta.prefills.append(PrefillSeq(row, c.num_tokens, ctx_len, table))
        row += c.num_tokens
    return ModelInputs(tensor(ids), tensor(positions), meta, tensor(sample_rows), sample_chunks, has_spec, chunk_rows)


def long_tensor(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 tensor of a list of ints (or of equally long lists of ints): on CPU
    wrapped around an `array` of them (`torch.frombuffer`), ~3x cheaper than
    `torch.tensor`'s element-by-element parse (1 / 64 / 2,048 values: 1.0 vs 3.0,
    2.3 vs 6.6, 32 vs 112 us, Zen 4); a one-row decode step builds six."""
    if device.type != "cpu" or not values:
        return torch.tensor(values, dtype=torch.long, device=device)
    if isinstance(values[0], list):
        rows = values
        width = len(rows[0])
        if any(len(row) != width for row in rows):  # ragged: torch.tensor's error
            return torch.tensor(values, dtype=torch.long)
        return long_tensor([v for row in rows for v in row], device).view(len(rows), width)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def decode_group(
    first_row: int, rows: list[tuple[list[int], int]], block_size: int, tensor: Callable[..., torch.Tensor]
) -> DecodeGroup:
    lens = [n for _, n in rows]
    width = cdiv(max(lens), block_size)
    tables = [block_ids[: cdiv(n, block_size)] for block_ids, n in rows]
    block_tables = tensor([t + [0] * (width - len(t)) for t in tables])
    return DecodeGroup(first_row, len(rows), block_tables, tensor(lens), block_size)
