"""The engine-core busy loop: drain the inbox, step, report.

It knows nothing of pipes or threads: the engine process (core_proc) feeds it
from a pipe, the in-process mode (core_client.ThreadEngineClient) from a queue.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kiln.llm.engine.messages import (
    Abort,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    Ready,
    Shutdown,
    StepResult,
    ToEngine,
    failed_output,
)

if TYPE_CHECKING:  # the API process imports this module, and never the model code
    from kiln.llm.engine.core import EngineCore
    from kiln.llm.models.checkpoint import Checkpoint

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how long an idle engine blocks on its inbox before re-checking its parent

# Returns the next inbox messages: waits up to `timeout` seconds for the first
# (0 = do not wait), then takes whatever else is already there.
Inbox = Callable[[float], list[ToEngine]]


class EngineLoop:
    """Drain the inbox, step the core while it has work, report every step.

    Invariant: every request the core holds has arrived through the inbox, and
    each `step()` result is sent before the next inbox drain, so an abort takes
    effect (and frees its KV blocks) at the next step boundary.
    """

    def __init__(self, core: EngineCore, inbox: Inbox, send: Callable[[StepResult], None], alive: Callable[[], bool]):
        self.core = core
        self.inbox = inbox
        self.send = send
        self.alive = alive
        self.unscheduled: dict[str, float] = {}  # request id -> arrival (monotonic)
        self.stopped = False

    def run(self) -> None:
        while not self.stopped and self.alive():
            self.core.check_health()  # a dead parallel worker ends the loop with EngineDeadError
            busy = self.core.has_unfinished()
            # Idle: fault in a piece of the KV pool (a few ms at most), then
            # only peek at the inbox until the pool is all in.
            warming = not busy and self.core.warm_kv_pool()
            aborted = self.handle(self.inbox(0.0 if busy or warming else IDLE_POLL_S))
            if self.stopped:
                break
            if self.core.has_unfinished():
                self.step()
            elif aborted:
                # No step follows, so report the freed blocks now.
                self.send(StepResult(EngineCoreOutputs([], self.core.stats())))

    def handle(self, messages: list[ToEngine]) -> bool:
        """Apply inbox messages; True if any abort was applied (or a request
        was refused: either way blocks or a request changed without a step)."""
        aborted = False
        refused: list[EngineCoreOutput] = []
        for msg in messages:
            if isinstance(msg, AddRequest):
                try:
                    self.core.add_request(msg.request)
                except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
                    log.warning("request %s refused by the engine: %s", msg.request.request_id, e)
                    refused.append(failed_output(msg.request.request_id, e))
                    continue
                self.unscheduled[msg.request.request_id] = msg.request.arrival_time or time.monotonic()
            elif isinstance(msg, Abort):
                self.core.abort_requests(msg.request_ids)
                for rid in msg.request_ids:
                    self.unscheduled.pop(rid, None)
                aborted = True
            elif isinstance(msg, Shutdown):
                self.stopped = True
        if refused:
            self.send(StepResult(EngineCoreOutputs(refused, self.core.stats())))
        return aborted

    def step(self) -> None:
        started = time.monotonic()
        outputs = self.core.step()
        self.send(StepResult(outputs, self._newly_scheduled(started)))

    def _newly_scheduled(self, step_started: float) -> dict[str, float]:
        """Queue time of requests that got their first compute in the last step."""
        if not self.unscheduled:
            return {}
        requests = self.core.scheduler.requests
        done = {}
        for rid, arrival in self.unscheduled.items():
            request = requests.get(rid)
            if request is None or request.num_cached_tokens >= 0:  # admitted (or already finished)
                done[rid] = max(0.0, step_started - arrival)
        for rid in done:
            del self.unscheduled[rid]
        return done


def ready_message(core: EngineCore, checkpoint: Checkpoint) -> Ready:
    return Ready(
        max_model_len=core.max_model_len,
        vocab_size=checkpoint.arch.vocab_size,
        tokenizer_path=str(checkpoint.tokenizer_path),
        source=str(checkpoint.source),
        num_blocks=core.kv.pool.num_blocks,
        block_size=core.config.cache.block_size,
        pid=os.getpid(),
        worker_pids=core.runner.worker_pids,
        dtype=core.config.model.dtype,
        eos_token_ids=list(checkpoint.arch.eos_token_ids),
        **memory_bytes(core.runner),
    )


def memory_bytes(runner: object) -> dict[str, int]:
    """Bytes of the model's weights in their serving layout (parameters and
    buffers, a tied tensor once), of the oneDNN copies kept for prefill
    (`packed`), of the KV pool and of the largest step's activations at
    their peak (measured at start-up; 0 if not), for a single-process runner;
    nothing for a parallel one (its ranks hold shards)."""
    model, caches = getattr(runner, "model", None), getattr(runner, "kv_caches", None)
    if model is None or caches is None:
        return {}
    packed = [p for m in model.modules() if (p := getattr(m, "packed", None)) is not None]
    head = getattr(model, "lm_head_packed", None)
    return {
        "weights_bytes": _bytes([*model.parameters(), *model.buffers()]),
        "packed_bytes": _bytes([*packed, *([head] if head is not None else [])]),
        "kv_cache_bytes": _bytes(caches),
        "activations_peak_bytes": getattr(runner, "activations_peak_bytes", None) or 0,
    }


def _bytes(tensors: list) -> int:
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())
