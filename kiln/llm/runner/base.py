"""What the engine core needs of a runner, as one declared interface.

ModelRunner (one process) and ParallelRunner (a TP x PP group, driven from
rank 0) both satisfy it; EngineCore, the builder's proposer wiring and the
tests' fake runner know nothing more.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kiln.llm.request import Request
from kiln.llm.sampling.sampler import Sampler
from kiln.llm.scheduler.output import RunnerOutput, SchedulerOutput
from kiln.llm.spec_decode.proposer import Proposer


class Runner(Protocol):
    @property
    def device(self) -> torch.device: ...

    @property
    def sampler(self) -> Sampler:
        """Samples every request's tokens; the core tells it when a request is gone (`forget`)."""
        ...

    @property
    def proposer(self) -> Proposer | None:
        """Speculative decoding's draft source, or None when it is off."""
        ...

    @property
    def worker_pids(self) -> list[int]:
        """Processes this runner started (parallel workers); [] for none."""
        ...

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step; sampled tokens for the chunks that sample."""
        ...

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """Up to num_drafts[i] draft tokens for requests[i] ([] each without a proposer)."""
        ...

    def logits_for(self, sched: SchedulerOutput) -> torch.Tensor:
        """Test hook: run a step and return the logits of every fed token."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError if a part of the runner (a worker) is gone."""
        ...

    def warm_kv_pool(self) -> bool:
        """Fault in the next piece of a lazily-paged KV pool (the engine calls it
        while idle); False once there is nothing (more) to do."""
        ...

    def shutdown(self) -> None:
        """Release what the runner holds outside this process."""
        ...
