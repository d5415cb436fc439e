"""The engine core: one busy loop of schedule -> execute -> update.

Knows token ids only; tokenization, detokenization and stop strings live
on the API side (`output_processor`), which may be another process.

Structured outputs (kiln.llm.structured): a constrained request waits for
its grammar outside the scheduler; each step the masks of its sampled rows
are filled on a worker thread while the runner's forward pass runs, and the
sampler applies them; after the step its matcher accepts the new tokens and
its drafts are trimmed to what the grammar accepts.

One request cannot take the engine down with it: what depends on a request's
own parameters is prepared when it is added (`add_request` raises, and the
loop fails that request alone), and a step that raises anyway is re-run in
halves until the failure is pinned on single requests, which end with
finish reason "error" while the rest of the batch gets its tokens. Only a step
in which every request fails on its own (or a lost parallel worker) is the
engine's failure. Every failure of one request, whenever it happens (a
grammar that does not compile, one that refuses a token, a failed step),
ends it through `_fail` with one output (`messages.failed_output`): a request's own
bad input (InvalidRequestError) is the client's to fix, anything else the
engine's.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kiln.config import EngineConfig
from kiln.errors import InvalidRequestError
from kiln.llm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats, failed_output
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.outputs import TokenLogprob
from kiln.llm.request import Request, RequestStatus
from kiln.llm.runner.base import Runner
from kiln.llm.runner.prompt_outputs import wants_prompt_outputs
from kiln.llm.scheduler.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from kiln.llm.scheduler.scheduler import Scheduler
from kiln.llm.spec_decode.proposer import Proposer, plan_drafts
from kiln.llm.structured.matchers import StructuredOutputs

GRAMMAR_POLL_S = 0.005  # an otherwise idle step waits this long for a grammar to compile

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, num_blocks: int, max_model_len: int):
        self.config = config
        self.runner = runner
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len)
        # Grammar state (set by the builder, which knows the tokenizer); None: no structured outputs.
        self.structured: StructuredOutputs | None = None

    def add_request(self, msg: EngineCoreRequest) -> None:
        """Queue a request; raises (and queues nothing) if the engine cannot run it."""
        request = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=msg.sampling_params,
            eos_token_ids=tuple(msg.eos_token_ids),
            priority=msg.priority,
            arrival_time=msg.arrival_time or time.monotonic(),
            pooling=msg.pooling,
        )
        if msg.request_id in self.scheduler.requests or (
            self.structured is not None and msg.request_id in self.structured.pending
        ):
            raise ValueError(f"request id {msg.request_id!r} is already running")
        if wants_prompt_outputs(request) and not getattr(self.runner, "supports_prompt_outputs", False):
            raise InvalidRequestError(
                "embeddings and prompt logprobs are not supported with tensor or pipeline parallelism",
                param="model" if request.sampling_params.prompt_logprobs is None else "prompt_logprobs",
            )
        structured = request.sampling_params.structured is not None
        if structured and self.structured is None:
            raise InvalidRequestError("structured outputs are not available on this engine", param="response_format")
        self.runner.sampler.admit(request)
        if structured:
            assert self.structured is not None
            self.structured.submit(request)
        else:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            compiling = self.structured is not None and rid in self.structured.pending
            if self.scheduler.abort(rid) is not None or compiling:
                self._forget(rid)  # its sampler state, partial embedding, grammar

    def has_unfinished(self) -> bool:
        pending = self.structured is not None and bool(self.structured.pending)
        return self.scheduler.has_unfinished() or pending

    def check_health(self) -> None:
        """Raise EngineDeadError if part of the engine (a parallel worker) is gone."""
        self.runner.check_health()

    def warm_kv_pool(self) -> bool:
        """One piece of idle-time KV pool warming (cache.warm_kv_pool); False when done or off."""
        return self.config.cache.warm_kv_pool and self.runner.warm_kv_pool()

    def shutdown(self) -> None:
        """Release what the runner holds outside this process (parallel workers)."""
        if self.structured is not None:
            self.structured.shutdown()
        self.runner.shutdown()

    def step(self) -> EngineCoreOutputs:
        started = time.perf_counter()
        failures = self._admit_compiled()
        sched = self.scheduler.schedule()
        result, failed = self._execute(sched) if sched else (RunnerOutput(), {})
        failures += [self._fail(rid, message) for rid, message in failed.items()]
        self._collect_prompt_logprobs(sched, result)
        touched = self.scheduler.update(sched, result)
        if self.structured is not None:
            touched, refused = self._advance_grammars(touched)
            failures += refused
            if not sched and self.structured.pending:
                self.structured.wait_pending(GRAMMAR_POLL_S)
        if self.runner.proposer is not None:
            self._propose(self.runner.proposer)
        outputs = [self._output(r, result) for r in touched]
        stats = self.stats(len(sched.chunks), time.perf_counter() - started)
        return EngineCoreOutputs(failures + outputs, stats)

    def _execute(self, sched: SchedulerOutput) -> tuple[RunnerOutput, dict[str, str]]:
        """Run the step, grammar masks filled meanwhile (see kiln.llm.structured);
        if it raises, (what the requests that do run gave, {failed id: why})."""
        masks = self.structured.start_step(sched.chunks) if self.structured is not None else None
        self.runner.sampler.constraints = masks  # keyed by request: valid for any part of the batch
        try:
            return self._execute_isolating(sched)
        finally:
            self.runner.sampler.constraints = None
            if masks is not None:
                masks.future.exception()  # the worker is done before any matcher moves on (a failed
                # fill has failed the requests that sampled with it, in the runner)

    def _execute_isolating(self, sched: SchedulerOutput) -> tuple[RunnerOutput, dict[str, str]]:
        restore = self._rerun_state(sched.chunks)
        try:
            return self.runner.execute(sched), {}
        except Exception as error:  # noqa: BLE001 - pinned on requests below, or re-raised
            self.runner.check_health()  # a lost worker is the engine's failure, not a request's
            log.warning("engine step failed (%s: %s); isolating the requests at fault",
                        type(error).__name__, error)
            restore()
            result, failed = self._isolate(sched.chunks, error)
            if len(sched.chunks) > 1 and len(failed) == len(sched.chunks):
                raise  # every request fails alone: the engine is broken
            return result, failed

    def _isolate(self, chunks: list[ScheduledChunk], error: Exception) -> tuple[RunnerOutput, dict[str, str]]:
        """Re-run the halves of a failed batch until each failure is one request's.

        Re-running is safe: a chunk's keys and values land in the same slots
        again, the scheduler advances nothing until `update`, and what the
        runner keeps on a request across chunks is put back before a re-run
        (`_rerun_state`)."""
        if len(chunks) == 1:
            return RunnerOutput(), {chunks[0].request.request_id: f"{type(error).__name__}: {error}"}
        merged, failed = RunnerOutput(), dict[str, str]()
        middle = len(chunks) // 2
        for half in (chunks[:middle], chunks[middle:]):
            restore = self._rerun_state(half)
            try:
                part, part_failed = self.runner.execute(SchedulerOutput(half)), dict[str, str]()
            except Exception as half_error:  # noqa: BLE001 - narrowed further
                restore()
                part, part_failed = self._isolate(half, half_error)
            merged.sampled.update(part.sampled)
            merged.spec_sampled.update(part.spec_sampled)
            merged.embeddings.update(part.embeddings)
            merged.prompt_logprobs.update(part.prompt_logprobs)
            failed.update(part_failed)
        return merged, failed

    def _rerun_state(self, chunks: list[ScheduledChunk]) -> Callable[[], None]:
        """What running these chunks changes outside the KV cache (prompt
        logprobs reported so far, partial embedding sums), and a function
        that puts it back, so a chunk re-run after a failed step counts once."""
        done = [(c.request, c.request.num_prompt_logprobs_done) for c in chunks]
        pooler = getattr(self.runner, "pooler", None)
        sums = dict(pooler.sums) if pooler is not None else {}
        ids = [c.request.request_id for c in chunks]

        def restore() -> None:
            for request, count in done:
                request.num_prompt_logprobs_done = count
            if pooler is not None:
                for rid in ids:
                    if rid in sums:
                        pooler.sums[rid] = sums[rid]
                    else:
                        pooler.sums.pop(rid, None)

        return restore

    def _fail(self, request_id: str, error: Exception | str) -> EngineCoreOutput:
        """End one request that failed in the engine (wherever it is: waiting
        for its grammar, queued or running); the rest of the engine goes on."""
        log.warning("request %s failed in the engine: %s", request_id, error)
        request = self.scheduler.fail(request_id)
        self._forget(request_id)
        return failed_output(request_id, error, request.num_preemptions if request is not None else 0)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammar compiled join the scheduler; those whose did not fail (a 400)."""
        if self.structured is None or not self.structured.pending:
            return []
        ready, not_compiled = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        return [self._fail(request.request_id, InvalidRequestError(message, param="response_format"))
                for request, message in not_compiled]

    def _advance_grammars(self, touched: list[Request]) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Matchers accept the step's tokens; a request whose grammar is
        complete without a stop token finishes; one the grammar refused fails
        (the sampler's mask allowed the token, so that is the engine's fault)."""
        assert self.structured is not None
        kept, refused = [], []
        for request in touched:
            error = self.structured.accept(request)
            if error is not None:
                refused.append(self._fail(request.request_id, error))
                continue
            if not request.is_finished and self.structured.is_terminated(request.request_id):
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            kept.append(request)
        return kept, refused

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
