"""What the driver tells every rank, as typed msgspec bytes broadcast over
the process group in a uint8 tensor (length first). Never pickle.

    WorkerInit   once, after the group forms: the engine config and pool size
    StepPlan     each engine step: the scheduled chunks, flattened
    Heartbeat    while idle, so a dead peer is noticed without a request
    ReportWeights  each rank's resident weight bytes (model.gather_weight_bytes; tests, metrics)
    Stop         shut down cleanly
"""
from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from kiln.config import EngineConfig


class PlanChunk(msgspec.Struct, array_like=True):
    """A ScheduledChunk without its Request: what `build_inputs` reads."""

    index: int  # position in the driver's SchedulerOutput.chunks
    ids: list[int]
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool
    draft_token_ids: list[int] = []
    feeds_prompt: bool = False  # ScheduledChunk.feeds_prompt

    def token_ids(self) -> list[int]:
        return self.ids


class WorkerInit(msgspec.Struct, tag="init"):
    config: EngineConfig
    num_blocks: int
    max_model_len: int


class StepPlan(msgspec.Struct, tag="step"):
    chunks: list[PlanChunk]
    micro_batches: list[list[int]]  # indexes into chunks, one list per micro-batch
    all_logits: bool = False  # test hook: logits for every fed token, not only sampled ones


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    pass


class Stop(msgspec.Struct, tag="stop"):
    pass


class ReportWeights(msgspec.Struct, tag="report_weights"):
    """Every rank answers with an all_gather of its resident weight bytes."""


Plan = WorkerInit | StepPlan | Heartbeat | Stop | ReportWeights
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Plan)


# Plans travel as CPU tensors: over gloo, also when the model runs on CUDA.


def broadcast_plan(plan: Plan) -> int:
    """Driver side (rank 0); returns the payload size in bytes."""
    payload = _encoder.encode(plan)
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)
    return len(payload)


def receive_plan() -> Plan:
    """Worker side: blocks until the driver broadcasts."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return _decoder.decode(data.cpu().numpy().tobytes())


def split_micro_batches(token_counts: list[int], parts: int) -> list[list[int]]:
    """Contiguous runs of chunk indexes with near-equal token counts; at most
    `parts` runs, none empty."""
    parts = max(1, min(parts, len(token_counts)))
    total = sum(token_counts)
    runs: list[list[int]] = [[]]
    done = 0
    for i, n in enumerate(token_counts):
        left = len(token_counts) - i  # chunks not yet placed, this one included
        need_new = runs[-1] and len(runs) < parts and (
            done >= total * len(runs) / parts or left <= parts - len(runs)
        )
        if need_new:
            runs.append([])
        runs[-1].append(i)
        done += n
    return runs
