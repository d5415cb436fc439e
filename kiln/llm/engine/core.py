"""The engine core: one busy loop of schedule -> execute -> update.

Knows token ids only; tokenization, detokenization and stop strings live
on the API side (`output_processor`), which may be another process.
"""
from __future__ import annotations

import time

from kiln.config import EngineConfig
from kiln.llm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.outputs import TokenLogprob
from kiln.llm.request import Request
from kiln.llm.runner.base import Runner
from kiln.llm.scheduler.output import RunnerOutput
from kiln.llm.scheduler.scheduler import Scheduler
from kiln.llm.spec_decode.proposer import Proposer, plan_drafts


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, num_blocks: int, max_model_len: int):
        self.config = config
        self.runner = runner
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len)

    def add_request(self, msg: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request_id=msg.request_id,
                prompt_token_ids=list(msg.prompt_token_ids),
                sampling_params=msg.sampling_params,
                eos_token_ids=tuple(msg.eos_token_ids),
                priority=msg.priority,
                arrival_time=msg.arrival_time or time.monotonic(),
            )
        )

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
        result = self.runner.execute(sched) if sched else RunnerOutput()
        touched = self.scheduler.update(sched, result)
        if self.runner.proposer is not None:
            self._propose(self.runner.proposer)
        outputs = [self._output(r, result) for r in touched]
        stats = self.stats(len(sched.chunks), time.perf_counter() - started)
        return EngineCoreOutputs(outputs, stats)

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
