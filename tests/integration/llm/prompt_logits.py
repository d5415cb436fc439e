"""Prompt logits straight from the engine's runner (one test helper for the
SmolLM2 numerics and the tiny family checkpoints)."""
from __future__ import annotations

import torch

from kiln import LLM, SamplingParams
from kiln.llm.request import Request
from kiln.llm.scheduler.output import ScheduledChunk, SchedulerOutput


def kiln_prompt_logits(llm: LLM, token_ids: list[int], split: int = 0) -> torch.Tensor:
    """Logits for prompt positions split.. from one flattened prefill step;
    with split > 0 a first chunk writes positions ..split into the pool and
    the second chunk reads their keys and values back from it."""
    core = llm.engine.core
    req = Request("logits", token_ids, SamplingParams(max_tokens=1))
    core.kv.allocate(req, len(token_ids))
    try:
        blocks = core.kv.block_ids("logits")
        if split:
            core.runner.logits_for(SchedulerOutput([ScheduledChunk(req, 0, split, blocks)]))
        return core.runner.logits_for(SchedulerOutput([ScheduledChunk(req, split, len(token_ids) - split, blocks)]))
    finally:
        core.kv.free(req)
