"""Flattens a step's scheduled chunks into model inputs (no padding)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.attention.metadata import AttentionMetadata, PrefillSeq
from kiln.llm.scheduler.output import ScheduledChunk


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states to compute logits for
    sample_chunks: list[ScheduledChunk]  # same order as sample_rows


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> ModelInputs:
    decodes = [c for c in chunks if c.num_tokens == 1 and c.start > 0]
    prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_chunks: list[ScheduledChunk] = []
    for c in decodes + prefills:
        end = c.start + c.num_tokens
        ids.extend(c.request.token_slice(c.start, end))
        positions.extend(range(c.start, end))
        slots.extend(slots_for(c.block_ids, c.start, end, block_size))
        if c.sample:
            sample_rows.append(len(ids) - 1)
            sample_chunks.append(c)

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = AttentionMetadata(slot_mapping=tensor(slots), num_decodes=len(decodes))
    if decodes:
        lens = [c.start + 1 for c in decodes]
        width = max(lens)
        padded = [slots_for(c.block_ids, 0, n, block_size) + [0] * (width - n) for c, n in zip(decodes, lens)]
        meta.decode_slots = tensor(padded)
        meta.decode_mask = (torch.arange(width, device=device).unsqueeze(0) < tensor(lens).unsqueeze(1))[
            :, None, None, :
        ]
    row = len(decodes)
    for c in prefills:
        ctx_len = c.start + c.num_tokens
        ctx = None if c.start == 0 else tensor(slots_for(c.block_ids, 0, ctx_len, block_size))
        meta.prefills.append(PrefillSeq(row, c.num_tokens, ctx_len, ctx))
        row += c.num_tokens
    return ModelInputs(tensor(ids), tensor(positions), meta, tensor(sample_rows), sample_chunks)
