"""Run one step plan on this rank: its micro-batches through its stage.

Per micro-batch: take token ids (first stage) or receive the previous
stage's hidden states, run this stage's layers (TP all-reduces inside),
then send the hidden states on, or, on the last stage, compute this rank's
vocabulary columns for the rows to sample and gather them on TP rank 0,
which hands them to the driver. Sends are non-blocking, so stage s works on
micro-batch i+1 while stage s+1 works on micro-batch i (forward-only GPipe
within one engine step).

Every rank sees the same plan, so every rank agrees on shapes and on which
collectives happen; nothing about shapes crosses the wire.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.llm.parallel.model import ShardedLlamaModel
from kiln.llm.parallel.plan import PlanChunk, StepPlan
from kiln.llm.parallel.state import ParallelState
from kiln.llm.runner.inputs import build_inputs


@dataclass
class MicroBatchLogits:
    chunks: list[PlanChunk]  # the sampled chunks, in logit-row order
    logits: torch.Tensor  # [rows, vocab] float32


class StageRunner:
    def __init__(
        self, model: ShardedLlamaModel, state: ParallelState, num_blocks: int, block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        self.model, self.state, self.block_size = model, state, block_size
        split, a = model.split, model.arch
        # This rank's slice of the paged pool: its layers, its KV heads.
        self.kv_caches = [
            torch.zeros(
                2, num_blocks * block_size, split.num_kv_heads, a.head_dim, dtype=kv_cache_dtype or model.dtype,
                device=state.device,
            )
            for _ in model.layers
        ]

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[MicroBatchLogits]:
        """Returns the gathered logits on the driver (rank 0); [] elsewhere."""
        s, a = self.state, self.model.arch
        pending: list[dist.Work] = []  # non-blocking sends, waited for at the end
        keep: list[torch.Tensor] = []  # what they send, alive until then
        results: list[MicroBatchLogits] = []
        waiting_rows: list[tuple[list[PlanChunk], int]] = []  # driver, PP > 1: logits still to receive
        for mb in plan.micro_batches:
            inputs = build_inputs([plan.chunks[i] for i in mb], self.block_size, s.device)
            n = inputs.input_ids.numel()
            rows = torch.arange(n, device=s.device) if plan.all_logits else inputs.sample_rows
            chunks = list(inputs.sample_chunks) if not plan.all_logits else []
            if s.is_first_stage:
                x = inputs.input_ids
            else:
                x = torch.empty(n, a.hidden_size, dtype=self.model.dtype, device=s.device)
                dist.recv(x, src=s.global_rank(s.pp_rank - 1, s.tp_rank))
            hidden = self.model(x, inputs.positions, self.kv_caches, inputs.meta)
            if not s.is_last_stage:
                hidden = hidden.contiguous()
                keep.append(hidden)
                pending.append(_isend(hidden, s.global_rank(s.pp_rank + 1, s.tp_rank)))
                if s.rank == 0 and rows.numel():
                    waiting_rows.append((chunks, rows.numel()))
                continue
            if rows.numel() == 0:
                continue
            full = s.gather_vocab(self.model.compute_logits(hidden[rows]))
            if full is None:
                continue
            full = full[:, : a.vocab_size].contiguous()
            if s.rank == 0:
                results.append(MicroBatchLogits(chunks, full))
            else:
                keep.append(full)
                pending.append(_isend(full, 0))
        for chunks, count in waiting_rows:
            logits = torch.empty(count, a.vocab_size, dtype=torch.float32, device=s.device)
            dist.recv(logits, src=s.logits_rank)
            results.append(MicroBatchLogits(chunks, logits))
        for work in pending:
            work.wait()
        return results


def _isend(tensor: torch.Tensor, dst: int) -> dist.Work:
    work = dist.isend(tensor, dst=dst)
    if work is None:  # only when this rank is not in the group, which a stage never is
        raise RuntimeError(f"isend to rank {dst} returned no work handle")
    return work
