"""Attention over the paged KV pool: the interface and its torch reference.

The reference runs on CPU and CUDA with plain tensor ops: decodes are
batched into one SDPA call over gathered, padded contexts; prefill chunks go
one at a time (they are compute-bound, so the loop costs little). On CPU
(fp32, bf16 or fp16 queries), decodes take Kiln's paged kernel instead, which
reads the pool in place (kiln/llm/kernels/paged_attention.cpp), prefill
chunks its register-tiled causal kernel (prefill_attention.cpp), and the
step's keys and values go into the pool by kv_write.cpp; results agree to
float rounding.

A layer's `AttentionOptions` (softmax scale, sliding window, logit
soft-capping) are fixed when its backend is made. A sliding window is a
mask: every layer shares one block table per sequence (the pool is shared by
all layers), so no block is freed for a window layer; the CPU decode kernel
starts reading at the window, the reference masks the keys before it (see
docs/models.md (Sliding-window attention)).
"""
from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from kiln.llm.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSeq
from kiln.llm.attention.options import AttentionOptions
from kiln.llm.kernels.ops import paged_decode_attention, prefill_attention, write_kv


class AttentionBackend(abc.ABC):
    options: AttentionOptions = AttentionOptions()

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, slots, KVH, D].
        Writes k, v into the pool, returns [T, H, D]."""


class TorchPagedAttention(AttentionBackend):
    def __init__(self, options: AttentionOptions | None = None):
        self.options = options or AttentionOptions()

    def forward(self, q, k, v, kv_cache, meta):
        if not write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping):
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

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, block_size: int) -> torch.Tensor:
        o = self.options
        scale = o.scale_for(q.shape[-1])
        out = paged_decode_attention(
            q, kv_cache[0], kv_cache[1], group.block_tables, group.context_lens, block_size, scale,
            o.sliding_window, o.logit_softcap,
        )
        if out is not None:
            return out
        keys = gather_blocks(kv_cache[0], group.block_tables, block_size).to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
        values = gather_blocks(kv_cache[1], group.block_tables, block_size).to(q.dtype).transpose(1, 2)
        mask = group.mask
        if o.sliding_window:
            key_pos = torch.arange(mask.shape[-1], device=q.device)
            first = (group.context_lens - o.sliding_window).view(-1, 1, 1, 1)
            mask = mask & (key_pos >= first)
        return attend(q.unsqueeze(2), keys, values, mask, False, o, scale).squeeze(2)  # [B, H, D]

    def _prefill(self, q, k, v, kv_cache, seq: PrefillSeq, block_size: int) -> torch.Tensor:
        o = self.options
        if seq.block_table is None:
            # A whole prompt attends to its fresh keys and values as the pool now holds them, so a
            # prompt prefilled in chunks, or after a prefix-cache hit, which reads them back from the
            # pool, gets the same scores, bit for bit.
            keys, values, offset = as_stored(k, kv_cache.dtype), as_stored(v, kv_cache.dtype), 0
        else:
            keys = gather_blocks(kv_cache[0], seq.block_table, block_size)[: seq.ctx_len].to(q.dtype)
            values = gather_blocks(kv_cache[1], seq.block_table, block_size)[: seq.ctx_len].to(q.dtype)
            offset = seq.ctx_len - seq.q_len
        out = prefill_attention(q, keys, values, o.scale_for(q.shape[-1]), o.sliding_window or 0, o.logit_softcap)
        if out is not None:
            return out
        mask, causal = None, True
        if offset or o.sliding_window:
            q_pos = torch.arange(seq.q_len, device=q.device).unsqueeze(1) + offset
            key_pos = torch.arange(keys.shape[0], device=q.device).unsqueeze(0)
            mask, causal = key_pos <= q_pos, False
            if o.sliding_window:
                mask = mask & (key_pos > q_pos - o.sliding_window)
        out = attend(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            mask, causal, o, o.scale_for(q.shape[-1]),
        )  # [1, H, Q, D]
        return out.squeeze(0).transpose(0, 1)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    options: AttentionOptions, scale: float,
) -> torch.Tensor:
    """Softmax attention of q [B, H, Q, D] over keys/values [B, KVH, L, D]
    (mask: True = attend); SDPA unless the scores are soft-capped."""
    if options.logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True, scale=scale
        )
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    cap = options.logit_softcap
    scores = torch.tanh((q @ keys.transpose(-1, -2)) * scale / cap) * cap  # transformers' order
    if causal:
        mask = torch.ones(q.shape[-2], keys.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


def as_stored(t: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """`t` rounded as a 16-bit float pool stores it, in t's dtype (t itself when nothing rounds)."""
    if pool_dtype not in (torch.float16, torch.bfloat16) or t.dtype == pool_dtype:
        return t
    return t.to(pool_dtype).to(t.dtype)


def gather_blocks(pool: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """pool: [slots, KVH, D]; block_table: [..., nb] -> [..., nb * block_size, KVH, D]."""
    blocks = pool.view(-1, block_size, *pool.shape[1:])
    # index_select copies whole blocks, fewer and larger copies than advanced indexing
    # (see docs/benchmarks.md (Offline throughput (engine issue): Kiln vs naive Hugging Face)).
    picked = blocks.index_select(0, block_table.reshape(-1))
    return picked.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, *pool.shape[1:])
