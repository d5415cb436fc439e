"""Stand-ins for the model side of the engine: a runner that returns scripted
tokens (it satisfies kiln.llm.runner.base.Runner; no model, no tensors but
the sampler's) and a byte-level tokenizer with exact, known decodings."""
from __future__ import annotations

import torch

from kiln.llm.request import Request
from kiln.llm.runner.base import Runner
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling.sampler import Sampler
from kiln.llm.scheduler.output import RunnerOutput, SchedulerOutput
from kiln.llm.spec_decode.proposer import Proposer


class RecordingSampler(Sampler):
    """A real Sampler that also records which requests the core told it to forget."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.forgotten: list[str] = []

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)
        super().forget(request_id)


class ScriptedRunner:
    """Each sampling chunk of request r gets the next token of script[r]
    (with logprob/top if scripted as a SampledToken); every step's chunks are
    recorded as (request id, start, num_tokens)."""

    def __init__(self, script: dict[str, list[int | SampledToken]]):
        self.script = {rid: list(tokens) for rid, tokens in script.items()}
        self.device = torch.device("cpu")
        self.sampler = RecordingSampler()
        self.proposer: Proposer | None = None
        self.worker_pids: list[int] = []
        self.steps: list[list[tuple[str, int, int]]] = []
        self.closed = False

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in sched.chunks])
        out = RunnerOutput()
        for c in sched.chunks:
            if c.sample:
                token = self.script[c.request.request_id].pop(0)
                out.sampled[c.request.request_id] = token if isinstance(token, SampledToken) else SampledToken(token)
        return out

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        return [[] for _ in requests]

    def logits_for(self, sched: SchedulerOutput) -> torch.Tensor:
        return torch.zeros(sched.num_tokens, 1)

    def check_health(self) -> None:
        pass

    def warm_kv_pool(self) -> bool:
        return False

    def shutdown(self) -> None:
        self.closed = True


def as_runner(runner: ScriptedRunner) -> Runner:
    """Typed as the protocol, so mypy checks that the fake satisfies it."""
    return runner


class ByteTokenizer:
    """Token id -> the bytes it stands for; decode joins them and decodes
    UTF-8 (an incomplete character becomes U+FFFD, as with a real BPE)."""

    def __init__(self, pieces: dict[int, bytes], special: frozenset[int] = frozenset()):
        self.pieces = pieces
        self.special = special

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i in self.special)]
        return b"".join(self.pieces[i] for i in kept).decode("utf-8", errors="replace")
