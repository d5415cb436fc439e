"""Every typed message between the API side and the engine core.

    API process                               engine process
    ───────────                               ──────────────
    core_client ── AddRequest / Abort / ──►   EngineLoop: drain inbox,
                   Shutdown                   core.step(), send StepResult
                ◄── Ready / StepResult / ──
                    Failed

msgspec structs, so the same types cross a process boundary as msgpack
bytes (never pickle) or stay in-process as plain objects (the thread mode).
"""
from __future__ import annotations

import msgspec

from kiln.errors import InvalidRequestError
from kiln.llm.outputs import TokenLogprob
from kiln.llm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = 0.0
    pooling: str | None = None  # "last" | "mean": an embedding request (prefill only)


class EngineCoreOutput(msgspec.Struct):
    """New tokens of one request in one step; `finish_reason` set on its last."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (then `error` says why)
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None  # this request failed in the engine; the engine goes on (see `failed_output`)
    invalid: bool = False  # ... through its own input (a 400, e.g. a grammar that does not compile), else a 500
    error_param: str | None = None  # the request field at fault, when `invalid`
    embedding: list[float] | None = None  # pooled hidden state of an embedding request (not normalised)
    prompt_logprobs: list[TokenLogprob] | None = None  # for prompt positions not reported before


def failed_output(request_id: str, error: Exception | str, num_preemptions: int = 0) -> EngineCoreOutput:
    """The last output of a request that failed in the engine. An
    InvalidRequestError is the request's own fault (the client's to fix);
    anything else is the engine's."""
    if isinstance(error, InvalidRequestError):
        return EngineCoreOutput(request_id, [], finish_reason="error", num_preemptions=num_preemptions,
                                error=error.message, invalid=True, error_param=error.param)
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return EngineCoreOutput(request_id, [], finish_reason="error", num_preemptions=num_preemptions, error=message)


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


# ---- the protocol: what crosses the pipe -------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    """The engine has loaded its model; what the API side needs to know of it."""

    max_model_len: int
    vocab_size: int
    tokenizer_path: str
    source: str
    num_blocks: int
    block_size: int
    pid: int
    worker_pids: list[int] = []  # tensor/pipeline-parallel worker processes this engine spawned
    # Stop tokens of the checkpoint (config.json, generation_config.json, GGUF eos/eot) beyond the tokenizer's.
    eos_token_ids: list[int] = []
    # Memory this process holds (0: not known, e.g. with tensor/pipeline parallelism).
    weights_bytes: int = 0  # in the serving layout
    packed_bytes: int = 0  # oneDNN copies of weights kept for prefill
    kv_cache_bytes: int = 0
    activations_peak_bytes: int = 0  # of the largest step, measured at start-up (engine/activation_profile.py)
    dtype: str = ""  # the model's dtype, as chosen (`--dtype auto` resolved)


class StepResult(msgspec.Struct, tag="step"):
    outputs: EngineCoreOutputs
    # Requests first scheduled in this step -> seconds they waited since arrival.
    queue_times: dict[str, float] = {}


class Failed(msgspec.Struct, tag="failed"):
    message: str
    unusable_model: bool = False  # a ConfigError / ModelLoadError: the model or its settings, not the engine


ToEngine = AddRequest | Abort | Shutdown
FromEngine = Ready | StepResult | Failed

to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
encoder = msgspec.msgpack.Encoder()
