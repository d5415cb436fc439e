"""The engine core: one busy loop of schedule -> execute -> update.

Knows token ids only; tokenization, detokenization and stop strings live
on the API side (`output_processor`), which may be another process.

Structured outputs (kiln.llm.structured): a constrained request waits for
its grammar outside the scheduler; each step the masks of its sampled rows
are filled on a worker thread while the runner's forward pass runs, and the
sampler applies them; after the step its matcher accepts the new tokens and
its drafts are trimmed to what the grammar accepts.
"""
from __future__ import annotations

import time

from kiln.config import EngineConfig
from kiln.llm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.outputs import TokenLogprob
from kiln.llm.request import Request, RequestStatus
from kiln.llm.runner.base import Runner
from kiln.llm.scheduler.output import RunnerOutput, SchedulerOutput
from kiln.llm.scheduler.scheduler import Scheduler
from kiln.llm.spec_decode.proposer import Proposer, plan_drafts
from kiln.llm.structured.matchers import StructuredOutputs

GRAMMAR_POLL_S = 0.005  # an otherwise idle step waits this long for a grammar to compile


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, num_blocks: int, max_model_len: int):
        self.config = config
        self.runner = runner
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len)
        # Grammar state (set by the builder, which knows the tokenizer); None: no structured outputs.
        self.structured: StructuredOutputs | None = None
        self._failed: list[EngineCoreOutput] = []  # requests refused in the engine, reported next step

    def add_request(self, msg: EngineCoreRequest) -> None:
        request = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=msg.sampling_params,
            eos_token_ids=tuple(msg.eos_token_ids),
            priority=msg.priority,
            arrival_time=msg.arrival_time or time.monotonic(),
            pooling=msg.pooling,
        )
        if (request.prefill_only or request.sampling_params.prompt_logprobs is not None) and not getattr(
            self.runner, "supports_prompt_outputs", False
        ):
            self._fail(request, "embeddings and prompt logprobs are not supported with tensor or pipeline "
                       "parallelism")
        elif request.sampling_params.structured is None:
            self.scheduler.add_request(request)
        elif self.structured is None:
            self._fail(request, "structured outputs are not available on this engine")
        else:
            self.structured.submit(request)

    def _fail(self, request: Request, message: str) -> None:
        self._failed.append(EngineCoreOutput(request.request_id, [], finish_reason="abort", error=message))

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.structured is not None:
                self.structured.forget(rid)
            if self.scheduler.abort(rid) is not None:
                self._forget(rid)

    def has_unfinished(self) -> bool:
        pending = self.structured is not None and bool(self.structured.pending)
        return self.scheduler.has_unfinished() or pending or bool(self._failed)

    def check_health(self) -> None:
        """Raise EngineDeadError if part of the engine (a parallel worker) is gone."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Release what the runner holds outside this process (parallel workers)."""
        if self.structured is not None:
            self.structured.shutdown()
        self.runner.shutdown()

    def step(self) -> EngineCoreOutputs:
        started = time.perf_counter()
        self._admit_compiled()
        sched = self.scheduler.schedule()
        result = self._execute(sched) if sched else RunnerOutput()
        self._collect_prompt_logprobs(sched, result)
        touched = self.scheduler.update(sched, result)
        outputs = self._failed
        self._failed = []
        if self.structured is not None:
            touched = self._advance_grammars(touched)
            if not sched and self.structured.pending:
                self.structured.wait_pending(GRAMMAR_POLL_S)
        if self.runner.proposer is not None:
            self._propose(self.runner.proposer)
        outputs += [self._output(r, result) for r in touched]
        stats = self.stats(len(sched.chunks), time.perf_counter() - started)
        return EngineCoreOutputs(outputs, stats)

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step; grammar masks are filled meanwhile (see kiln.llm.structured)."""
        masks = self.structured.start_step(sched.chunks) if self.structured is not None else None
        self.runner.sampler.constraints = masks
        try:
            return self.runner.execute(sched)
        finally:
            self.runner.sampler.constraints = None
            if masks is not None:
                masks.result()  # the worker is done before any matcher moves on

    def _admit_compiled(self) -> None:
        if self.structured is None or not self.structured.pending:
            return
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for request, message in failed:
            self._fail(request, message)

    def _advance_grammars(self, touched: list[Request]) -> list[Request]:
        """Matchers accept the step's tokens; a request whose grammar is
        complete without a stop token finishes; one the grammar refused fails."""
        assert self.structured is not None
        kept = []
        for request in touched:
            error = self.structured.accept(request)
            if error is not None:
                self.scheduler.abort(request.request_id)
                self._forget(request.request_id)
                self._failed.append(EngineCoreOutput(request.request_id, [], finish_reason="abort", error=error))
                continue
            if not request.is_finished and self.structured.is_terminated(request.request_id):
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            kept.append(request)
        return kept

    def _forget(self, request_id: str) -> None:
        self.runner.sampler.forget(request_id)
        pooler = getattr(self.runner, "pooler", None)
        if pooler is not None:
            pooler.forget(request_id)
        if self.structured is not None:
            self.structured.forget(request_id)

    @staticmethod
    def _collect_prompt_logprobs(sched: SchedulerOutput, result: RunnerOutput) -> None:
        """Keep this step's prompt logprobs on their requests until reported."""
        if result.prompt_logprobs:
            for chunk in sched.chunks:
                entries = result.prompt_logprobs.get(chunk.request.request_id)
                if entries:
                    chunk.request.pending_prompt_logprobs.extend(entries)

    def _propose(self, proposer: Proposer) -> None:
        """Give decoding requests drafts for the next step (see plan_drafts)."""
        running = self.scheduler.running
        proposer.retain({r.request_id for r in running})
        chosen, counts = plan_drafts(running, self.config.spec, self.max_model_len)
        if chosen:
            for request, drafts in zip(chosen, self.runner.propose(chosen, counts), strict=False):
                if self.structured is not None:
                    drafts = self.structured.trim_drafts(request, drafts)
                request.spec_token_ids = drafts

    def _output(self, request: Request, result: RunnerOutput) -> EngineCoreOutput:
        if request.prefill_only:
            out = self._make_output(request, [], None)
            out.embedding = result.embeddings.get(request.request_id)
            return out
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
            self._forget(request.request_id)
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs, request.pending_prompt_logprobs = request.pending_prompt_logprobs, []
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_token_id=request.stop_token_id,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
            prompt_logprobs=prompt_logprobs,
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
