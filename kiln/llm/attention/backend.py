"""Attention over the paged KV pool: the interface and its torch reference.

The reference runs on CPU and CUDA with plain tensor ops: decodes are
batched into one SDPA call over gathered, padded contexts; prefill chunks go
one at a time (they are compute-bound, so the loop costs little). On CPU
(fp32, bf16 or fp16 queries), decodes take Kiln's paged kernel instead, which
reads the pool in place (kiln/llm/kernels/paged_attention.cpp); results
agree to float rounding.
"""
from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.kernels.ops import paged_decode_attention


class AttentionBackend(abc.ABC):
    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, slots, KVH, D].
        Writes k, v into the pool, returns [T, H, D]."""


class TorchPagedAttention(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta):
        kv_cache[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))  # no copy when dtypes agree
        kv_cache[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            rows = slice(group.first_row, group.first_row + group.num_seqs)
            out[rows] = self._decode(q[rows], kv_cache, group, meta.block_size)
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, seq, meta.block_size)
        return out

    @staticmethod
    def _decode(q, kv_cache, group, block_size):
        out = paged_decode_attention(q, kv_cache[0], kv_cache[1], group.block_tables, group.context_lens, block_size)
        if out is not None:
            return out
        keys = gather_blocks(kv_cache[0], group.block_tables, block_size).to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
        values = gather_blocks(kv_cache[1], group.block_tables, block_size).to(q.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=group.mask, enable_gqa=True
        )  # [B, H, 1, D]
        return out.squeeze(2)

    def _prefill(self, q, k, v, kv_cache, seq, block_size):
        if seq.block_table is None:
            keys, values, mask, causal = k, v, None, True
        else:
            keys = gather_blocks(kv_cache[0], seq.block_table, block_size)[: seq.ctx_len].to(q.dtype)
            values = gather_blocks(kv_cache[1], seq.block_table, block_size)[: seq.ctx_len].to(q.dtype)
            offset = seq.ctx_len - seq.q_len
            q_pos = torch.arange(seq.q_len, device=q.device).unsqueeze(1) + offset
            mask = torch.arange(seq.ctx_len, device=q.device).unsqueeze(0) <= q_pos
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )  # [1, H, Q, D]
        return out.squeeze(0).transpose(0, 1)


def gather_blocks(pool: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """pool: [slots, KVH, D]; block_table: [..., nb] -> [..., nb * block_size, KVH, D]."""
    blocks = pool.view(-1, block_size, *pool.shape[1:])
    # index_select copies whole blocks, fewer and larger copies than advanced indexing
    # (see docs/benchmarks.md (Offline throughput (engine issue): Kiln vs naive Hugging Face)).
    picked = blocks.index_select(0, block_table.reshape(-1))
    return picked.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, *pool.shape[1:])
