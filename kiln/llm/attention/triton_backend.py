"""Paged attention on CUDA through Kiln's Triton kernels.

Per layer: the step's keys and values go into the pool (triton_kv_write),
then every decode row in one launch (triton_decode) and every prefill chunk
in another (triton_prefill). The tensors those launches take (one flat block
table for all decode rows; per-chunk starts, lengths and tables) are built
once per step, by the first layer, and kept on the metadata (`kernel_plan`);
a CUDA graph sets them to its persistent buffers instead (runner/cuda_graphs).

An fp8 (e4m3) pool stores k / k_scale and v / v_scale with one scale per
layer and tensor (1.0 unless set), as the pool holds no scales itself.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.llm.attention.backend import AttentionBackend, as_stored
from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.attention.triton_decode import decode_attention, max_splits_for
from kiln.llm.attention.triton_kv_write import write_kv
from kiln.llm.attention.triton_prefill import prefill_attention
from kiln.llm.kernels.triton_env import interpreting

CPU_SMS = 4  # stands in for the multiprocessor count under Triton's interpreter


@dataclass
class DecodePlan:
    block_tables: torch.Tensor  # [N, W], every decode row's blocks (padded with block 0)
    context_lens: torch.Tensor  # [N]
    max_splits: int


@dataclass
class PrefillPlan:
    q_starts: torch.Tensor  # [S] first row of each chunk
    q_lens: torch.Tensor  # [S]
    prefix_lens: torch.Tensor  # [S] cached tokens before each chunk
    block_tables: torch.Tensor  # [S, W]
    max_q_len: int


@dataclass
class TritonPlan:
    num_decodes: int
    decode: DecodePlan | None
    prefill: PrefillPlan | None


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, num_kv_heads: int) -> DecodePlan:
    rows = block_tables.shape[0]
    return DecodePlan(block_tables, context_lens, max_splits_for(rows, num_kv_heads, num_sms(block_tables.device)))


def build_plan(meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> TritonPlan:
    decode = None
    if meta.decode_groups:
        decode = decode_plan(*meta.decode_tables(), num_kv_heads)
    prefill = None
    if meta.prefills:
        seqs = meta.prefills
        host = torch.tensor([[s.q_start for s in seqs], [s.q_len for s in seqs], [s.ctx_len - s.q_len for s in seqs]])
        if device.type == "cuda":
            host = host.pin_memory()
        starts, q_lens, prefix_lens = host.to(device, non_blocking=True)
        width = max((s.block_table.shape[0] for s in seqs if s.block_table is not None), default=1)
        empty = torch.zeros(width, dtype=torch.long, device=device)
        tables = torch.stack([
            empty if s.block_table is None else F.pad(s.block_table, (0, width - s.block_table.shape[0]))
            for s in seqs
        ])
        prefill = PrefillPlan(starts, q_lens, prefix_lens, tables, max(s.q_len for s in seqs))
    return TritonPlan(meta.num_decodes, decode, prefill)


class TritonPagedAttention(AttentionBackend):
    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        self.k_scale = k_scale
        self.v_scale = v_scale

    def forward(self, q, k, v, kv_cache, meta):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        k_scale, v_scale = (self.k_scale, self.v_scale) if fp8 else (1.0, 1.0)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        plan = meta.kernel_plan
        if not isinstance(plan, TritonPlan):
            plan = meta.kernel_plan = build_plan(meta, k.shape[1], q.device)
        out = torch.empty_like(q)
        dot_f32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting())
        if plan.decode is not None:
            n = plan.num_decodes
            d = plan.decode
            decode_attention(
                q[:n], k_cache, v_cache, d.block_tables, d.context_lens, meta.block_size, d.max_splits, out[:n],
                k_scale, v_scale, dot_f32,
            )
        if plan.prefill is not None:
            p = plan.prefill
            # A chunk attends to its own keys and values as a 16-bit pool holds them, as its
            # prefix is read back from the pool (an fp8 pool's chunk keeps them unrounded: triton_prefill).
            fresh_k, fresh_v = as_stored(k, kv_cache.dtype), as_stored(v, kv_cache.dtype)
            prefill_attention(
                q, fresh_k, fresh_v, k_cache, v_cache, p.q_starts, p.q_lens, p.prefix_lens, p.block_tables,
                p.max_q_len, meta.block_size, out, k_scale, v_scale, dot_f32,
            )
        return out
