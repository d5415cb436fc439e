"""The engine core: one busy loop of schedule -> execute -> update.

Knows token ids only; tokenization, detokenization and stop strings live
on the API side (`output_processor`), which may be another process.

One request cannot take the engine down with it: what depends on a request's
own parameters is prepared when it is added (`add_request` raises, and the
loop fails that request alone), and a step that raises anyway is re-run in
halves until the failure is pinned on single requests, which end with
finish reason "error" while the rest of the batch gets its tokens. Only a step
in which every request fails on its own (or a lost parallel worker) is the
engine's failure.
"""
from __future__ import annotations

import logging
import time

from kiln.config import EngineConfig
from kiln.llm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.outputs import TokenLogprob
from kiln.llm.request import Request
from kiln.llm.runner.base import Runner
from kiln.llm.scheduler.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from kiln.llm.scheduler.scheduler import Scheduler
from kiln.llm.spec_decode.proposer import Proposer, plan_drafts

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, num_blocks: int, max_model_len: int):
        self.config = config
        self.runner = runner
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len)

    def add_request(self, msg: EngineCoreRequest) -> None:
        """Queue a request; raises (and queues nothing) if the engine cannot run it."""
        request = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=msg.sampling_params,
            eos_token_ids=tuple(msg.eos_token_ids),
            priority=msg.priority,
            arrival_time=msg.arrival_time or time.monotonic(),
        )
        if msg.request_id in self.scheduler.requests:
            raise ValueError(f"request id {msg.request_id!r} is already running")
        self.runner.sampler.admit(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.scheduler.abort(rid) is not None:
                self.runner.sampler.forget(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise EngineDeadError if part of the engine (a parallel worker) is gone."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Release what the runner holds outside this process (parallel workers)."""
        self.runner.shutdown()

    def step(self) -> EngineCoreOutputs:
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        result, failed = self._execute(sched) if sched else (RunnerOutput(), {})
        errors = [self._fail(rid, message) for rid, message in failed.items()]
        touched = self.scheduler.update(sched, result)
        if self.runner.proposer is not None:
            self._propose(self.runner.proposer)
        outputs = [self._output(r, result) for r in touched]
        stats = self.stats(len(sched.chunks), time.perf_counter() - started)
        return EngineCoreOutputs(errors + outputs, stats)

    def _execute(self, sched: SchedulerOutput) -> tuple[RunnerOutput, dict[str, str]]:
        """Run the step; if it raises, (what the requests that do run gave, {failed id: why})."""
        try:
            return self.runner.execute(sched), {}
        except Exception as error:  # noqa: BLE001 - pinned on requests below, or re-raised
            self.runner.check_health()  # a lost worker is the engine's failure, not a request's
            log.warning("engine step failed (%s: %s); isolating the requests at fault",
                        type(error).__name__, error)
            result, failed = self._isolate(sched.chunks, error)
            if len(sched.chunks) > 1 and len(failed) == len(sched.chunks):
                raise  # every request fails alone: the engine is broken
            return result, failed

    def _isolate(self, chunks: list[ScheduledChunk], error: Exception) -> tuple[RunnerOutput, dict[str, str]]:
        """Re-run the halves of a failed batch until each failure is one request's.

        Re-running is safe: a chunk's keys and values land in the same slots
        again, and the scheduler advances nothing until `update`."""
        if len(chunks) == 1:
            return RunnerOutput(), {chunks[0].request.request_id: f"{type(error).__name__}: {error}"}
        merged, failed = RunnerOutput(), dict[str, str]()
        middle = len(chunks) // 2
        for half in (chunks[:middle], chunks[middle:]):
            try:
                part, part_failed = self.runner.execute(SchedulerOutput(half)), dict[str, str]()
            except Exception as half_error:  # noqa: BLE001 - narrowed further
                part, part_failed = self._isolate(half, half_error)
            merged.sampled.update(part.sampled)
            merged.spec_sampled.update(part.spec_sampled)
            failed.update(part_failed)
        return merged, failed

    def _fail(self, request_id: str, message: str) -> EngineCoreOutput:
        log.warning("request %s failed in the engine: %s", request_id, message)
        request = self.scheduler.fail(request_id)
        self.runner.sampler.forget(request_id)
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=[],
            finish_reason="error",
            num_preemptions=request.num_preemptions if request is not None else 0,
            error=message,
        )

    def _propose(self, proposer: Proposer) -> None:
        """Give decoding requests drafts for the next step (see plan_drafts)."""
        running = self.scheduler.running
        proposer.retain({r.request_id for r in running})
        chosen, counts = plan_drafts(running, self.config.spec, self.max_model_len)
        if chosen:
            for request, drafts in zip(chosen, self.runner.propose(chosen, counts), strict=False):
                request.spec_token_ids = drafts

    def _output(self, request: Request, result: RunnerOutput) -> EngineCoreOutput:
        spec = result.spec_sampled.get(request.request_id)
        if spec is not None:
            return self._make_output(request, [t.token_id for t in spec], None)
        sampled = result.sampled[request.request_id]
        logprobs = None
        if sampled.logprob is not None:
            logprobs = [TokenLogprob(sampled.token_id, sampled.logprob, sampled.top_logprobs or [])]
        return self._make_output(request, [sampled.token_id], logprobs)

    def _make_output(
        self, request: Request, new_token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> EngineCoreOutput:
        if request.is_finished:
            self.runner.sampler.forget(request.request_id)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_token_id=request.stop_token_id,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
        )

    def stats(self, num_seqs: int = 0, seconds: float = 0.0) -> EngineStats:
        """Gauges and totals now; `num_seqs`/`seconds` describe the step just
        run (zero outside a step, so nothing is counted twice)."""
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_scheduled_tokens=s.num_scheduled_tokens if num_seqs else 0,
            num_scheduled_seqs=num_seqs,
            step_seconds=seconds,
            spec_num_draft_tokens=self.scheduler.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.scheduler.spec_stats.num_accepted_tokens,
            spec_accepted_per_position=list(self.scheduler.spec_stats.accepted_per_position),
        )
