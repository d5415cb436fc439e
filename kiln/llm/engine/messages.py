"""Typed messages between the API side and the engine core.

msgspec structs, so the same types cross a process boundary as msgpack
bytes (never pickle) or stay in-process as plain objects.
"""
from __future__ import annotations

import msgspec

from kiln.llm.outputs import TokenLogprob
from kiln.llm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = 0.0


class EngineCoreOutput(msgspec.Struct):
    """New tokens of one request in one step; `finish_reason` set on its last."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


class EngineStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_scheduled_seqs: int = 0
    step_seconds: float = 0.0
    # Speculative decoding, running totals (0 / [] when off).
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []


class EngineCoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
