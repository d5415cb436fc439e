"""Iteration-level (continuous) batching under a token budget.

Each step: running requests first (decodes, then unfinished prompt chunks),
then waiting requests in the policy's order (queue.py: fcfs, or priority
with aging), while the token budget, the sequence limit and the KV pool
allow. Prefill and decode are the same thing here: a request asks for
`num_tokens - num_computed_tokens` more tokens. When the pool runs dry a
running request is preempted (its blocks freed, its tokens to be recomputed
later): under fcfs the most recently admitted; under priority the lowest
priority (the largest key; the most recently admitted among equals), and a
waiting request may also preempt running ones of strictly lower priority to
get in.

Prefill-only requests (embeddings, scoring a prompt with max_tokens 0) run
their prompt like any other and finish when the prompt is done: they never
sample and never hold a block for a decode. They, and requests asking for
prompt logprobs, skip the prefix-cache lookup (every position is computed).

Speculative decoding: a decoding request may carry draft tokens
(`Request.spec_token_ids`); it is then scheduled for 1 + drafts tokens
(drafts cut to fit the budget). After the step only verified tokens are
appended, `num_computed_tokens` advances by 1 + accepted drafts, and blocks
allocated for rejected drafts are freed (`KVCacheManager.rollback`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config import SchedulerConfig
from kiln.llm.kv_cache.manager import KVCacheManager, PrefixHit
from kiln.llm.request import Request, RequestStatus
from kiln.llm.sampling.output import SampledToken
from kiln.llm.scheduler.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from kiln.llm.scheduler.queue import make_waiting_queue, priority_key
from kiln.llm.scheduler.stopping import check_stop, prefill_only_status


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_scheduled_tokens: int


@dataclass
class SpecStats:
    """Running totals of speculative decoding."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = make_waiting_queue(config.scheduling_policy, config.priority_aging_s)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._last_scheduled_tokens = 0
        self.spec_stats = SpecStats()

    # ---- request lifecycle ------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def fail(self, request_id: str) -> Request | None:
        """End a request whose step failed (see EngineCore); its blocks are discarded."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.kv.discard(request)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefills = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            drafts = self._take_drafts(request, budget)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget) + len(drafts)
            if self._make_room(request, num_new, scheduled, out):
                budget -= num_new
                scheduled[request.request_id] = self._chunk(request, num_new, drafts)
            budget += self._reclaimed_budget
        if not out.preempted_ids:
            budget = self._admit_waiting(budget, scheduled, out)
        # Runner order: admission order, so a chunk never depends on a later one.
        out.chunks = [scheduled[r.request_id] for r in self.running if r.request_id in scheduled]
        self._last_scheduled_tokens = out.num_tokens
        return out

    def _take_drafts(self, request: Request, budget: int) -> list[int]:
        """The request's drafts that this step may verify: only for a decode
        (one token left to compute), within the budget and max_model_len."""
        drafts = request.spec_token_ids
        if not drafts:
            return drafts
        request.spec_token_ids = []
        if request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens)
        return drafts[: max(0, room)]

    def _make_room(self, request: Request, num_new: int, scheduled: dict, out: SchedulerOutput) -> bool:
        """Preempt from the back of `running` until `request` fits. False if
        `request` itself had to go."""
        self._reclaimed_budget = 0
        while not self.kv.can_allocate(request, num_new):
            victim = self._victim()
            self._reclaimed_budget += self._preempt_scheduled(victim, scheduled, out)
            if victim is request:
                return False
        self.kv.allocate(request, num_new)
        return True

    def _victim(self) -> Request:
        """The running request to preempt first."""
        if self.config.scheduling_policy != "priority":
            return self.running[-1]
        order = {id(r): i for i, r in enumerate(self.running)}
        return max(self.running, key=lambda r: (self._key(r), order[id(r)]))

    def _key(self, request: Request) -> tuple[float, float, int]:
        return priority_key(request, self.config.priority_aging_s)

    def _preempt_scheduled(self, victim: Request, scheduled: dict, out: SchedulerOutput) -> int:
        """Preempt `victim`; returns the budget its chunk of this step held."""
        self._preempt(victim)
        out.preempted_ids.append(victim.request_id)
        chunk = scheduled.pop(victim.request_id, None)
        return chunk.num_tokens if chunk is not None else 0

    def _displace_for(self, request: Request, scheduled: dict, out: SchedulerOutput) -> int | None:
        """Priority policy: preempt the worst running request if it ranks
        strictly below `request`; the budget it freed, or None if none does."""
        if self.config.scheduling_policy != "priority" or not self.running:
            return None
        victim = self._victim()
        if self._key(victim) <= self._key(request):
            return None
        return self._preempt_scheduled(victim, scheduled, out)

    def _admit_waiting(self, budget: int, scheduled: dict, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0:
            request = self.waiting.peek()
            if len(self.running) >= self.config.max_num_seqs:
                freed = self._displace_for(request, scheduled, out)
                if freed is None:
                    break
                budget += freed
                continue
            hit = PrefixHit([], 0) if request.needs_every_position else self.kv.find_prefix(request)
            remaining = request.num_tokens - hit.num_tokens
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.kv.can_allocate(request, num_new, hit):
                freed = self._displace_for(request, scheduled, out)
                if freed is None:
                    break
                budget += freed
                continue
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                self.kv.record_lookup(request, hit)
                request.num_cached_tokens = hit.num_tokens
            self.kv.allocate(request, num_new, hit)
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = self._chunk(request, num_new)
            budget -= num_new
        return budget

    def _chunk(self, request: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledChunk:
        block_ids = self.kv.block_ids(request.request_id)
        if drafts:
            return ScheduledChunk(request, request.num_computed_tokens, num_new, block_ids, drafts)
        return ScheduledChunk(request, request.num_computed_tokens, num_new, block_ids)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(request)

    # ---- after the model ran ----------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished
        requests (their blocks return at once). Returns requests that got a
        token or finished in this step."""
        touched = []
        for chunk in sched.chunks:
            request = chunk.request
            if request.is_finished:
                continue  # aborted while the step ran
            if chunk.draft_token_ids:
                self._update_spec(chunk, result.spec_sampled[request.request_id])
                touched.append(request)
                continue
            request.num_computed_tokens += chunk.num_tokens
            if request.prefill_only:
                if chunk.sample:  # the prompt is done: nothing to sample
                    self._finish(request, prefill_only_status(request))
                    touched.append(request)
                continue
            sampled = result.sampled.get(request.request_id)
            if sampled is None:
                continue
            request.output_token_ids.append(sampled.token_id)
            reason = check_stop(request, sampled.token_id, self.max_model_len)
            if reason is not None:
                self._finish(request, reason)
            touched.append(request)
        return touched

    def _update_spec(self, chunk: ScheduledChunk, tokens: list[SampledToken]) -> None:
        """Append verified tokens one by one, stopping at the first stop
        condition; `tokens` is trimmed in place to those appended."""
        request = chunk.request
        num_accepted = len(tokens) - 1
        self.spec_stats.record(len(chunk.draft_token_ids), num_accepted)
        # KV is valid for the fed last token and the accepted drafts only.
        request.num_computed_tokens += 1 + num_accepted
        for i, sampled in enumerate(tokens):
            request.output_token_ids.append(sampled.token_id)
            reason = check_stop(request, sampled.token_id, self.max_model_len)
            if reason is not None:
                del tokens[i + 1 :]
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                self._finish(request, reason)
                return
        self.kv.rollback(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request the engine core decided is done (its grammar is complete)."""
        if not request.is_finished:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.spec_token_ids = []
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=pool.num_blocks - pool.num_free,
            kv_blocks_total=pool.num_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=self._last_scheduled_tokens,
        )
