"""Engine-side grammar state: one xgrammar matcher per constrained request.

Life of a constrained request in the engine core:
  add      its grammar compiles on the backend's thread; the request waits
           outside the scheduler until it is ready (`take_ready`)
  step     `start_step` fills the masks of every row the step samples on a
           worker thread while the forward pass runs (torch releases the
           GIL); the sampler waits for them only when it needs them
  update   `accept` feeds the matcher the tokens the step appended
  propose  `trim_drafts` keeps the drafts the grammar accepts (checked one by
           one, then the matcher is rolled back), so a verified draft is
           always valid; a speculative row i is masked for output + d_1..d_i

Invariant: between steps a matcher has consumed exactly the request's
output tokens (`consumed`); masks are filled only between `start_step` and
the end of the step, and tokens accepted only after it, never concurrently.
"""
from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.llm.request import Request
from kiln.llm.scheduler.output import ScheduledChunk
from kiln.llm.structured.backend import GrammarBackend
from kiln.llm.structured.masks import RowKey, StepMasks


class StructuredOutputs:
    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self.matchers: dict[str, Any] = {}
        self.consumed: dict[str, int] = {}
        self.pending: dict[str, tuple[Request, Future]] = {}  # compiling, in arrival order
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kiln-masks")
        self.fill_seconds = 0.0  # total time spent filling masks (on the worker)

    # ---- requests ------------------------------------------------------------
    def submit(self, request: Request) -> None:
        spec = request.sampling_params.structured
        if spec is None:
            raise ValueError("request has no grammar")
        self.pending[request.request_id] = (request, self.backend.compile_async(spec))

    def wait_pending(self, timeout_s: float) -> None:
        futures = [f for _, f in self.pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar compiled (matcher made), and those whose did not (with why)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for rid, (request, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[rid]
            error = future.exception()
            if error is not None:
                failed.append((request, error.message if isinstance(error, KilnError) else str(error)))
                continue
            self.matchers[rid] = self._matcher(future.result(), request)
            self.consumed[rid] = 0
            ready.append(request)
        return ready, failed

    @staticmethod
    def _matcher(compiled: Any, request: Request) -> Any:
        import xgrammar

        p = request.sampling_params
        stops = sorted({*request.eos_token_ids, *p.stop_token_ids})
        return xgrammar.GrammarMatcher(
            compiled, override_stop_tokens=stops or None, terminate_without_stop_token=not stops
        )

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.matchers.pop(request_id, None)
        self.consumed.pop(request_id, None)

    def is_terminated(self, request_id: str) -> bool:
        matcher = self.matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    # ---- a step ---------------------------------------------------------------
    def start_step(self, chunks: list[ScheduledChunk]) -> StepMasks | None:
        """Start filling the masks of this step's constrained sampled rows."""
        jobs = [(c.request, list(c.draft_token_ids)) for c in chunks
                if c.sample and not c.request.prefill_only and c.request.request_id in self.matchers]
        if not jobs:
            return None
        return StepMasks(self._worker.submit(self._fill, jobs))

    def _fill(self, jobs: list[tuple[Request, list[int]]]) -> tuple[torch.Tensor, dict[RowKey, int]]:
        import time

        import xgrammar

        started = time.perf_counter()
        bitmask = xgrammar.allocate_token_bitmask(sum(1 + len(d) for _, d in jobs), self.backend.vocab_size)
        rows: dict[RowKey, int] = {}
        for request, drafts in jobs:
            matcher = self.matchers[request.request_id]
            n_out = request.num_output_tokens
            accepted = 0
            for i in range(1 + len(drafts)):
                rows[(request.request_id, n_out + i)] = row = len(rows)
                matcher.fill_next_token_bitmask(bitmask, row)
                if i < len(drafts):
                    if not matcher.accept_token(drafts[i]):
                        break  # trim_drafts keeps only valid drafts; never expected
                    accepted += 1
            if accepted:
                matcher.rollback(accepted)
        self.fill_seconds += time.perf_counter() - started
        return bitmask, rows

    def accept(self, request: Request) -> str | None:
        """Feed the matcher the request's new output tokens; why not, if the grammar refused one."""
        rid = request.request_id
        matcher = self.matchers.get(rid)
        if matcher is None:
            return None
        new = request.output_token_ids[self.consumed[rid] :]
        for token in new:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                return f"the grammar rejected token {token} (output position {self.consumed[rid]})"
            self.consumed[rid] += 1
        self.consumed[rid] = request.num_output_tokens
        return None

    def trim_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts (the matcher is left as it was)."""
        matcher = self.matchers.get(request.request_id)
        if matcher is None or not drafts:
            return drafts
        accepted = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return drafts[:accepted]

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self.backend.shutdown()
