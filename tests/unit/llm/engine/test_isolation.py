"""One request cannot take the engine down: a parameter the engine cannot use
fails that request when it is added, a step that raises is narrowed to the
requests at fault, and the rest of the batch (and every later request) is
served. The runner here samples with the real Sampler."""

from __future__ import annotations

import torch

from kiln.config import EngineConfig
from kiln.llm.engine.core import EngineCore
from kiln.llm.engine.loop import EngineLoop
from kiln.llm.engine.messages import AddRequest, EngineCoreOutput, EngineCoreRequest, StepResult
from kiln.llm.request import Request
from kiln.llm.runner.prompt_outputs import Pooler
from kiln.llm.sampling.sampler import Sampler
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler.output import RunnerOutput, SchedulerOutput
from kiln.llm.structured.spec import GrammarSpec
from tests.unit.llm.engine.fakes import ScriptedRunner, as_runner

VOCAB, NUM_BLOCKS, BLOCK_SIZE = 32, 16, 4


class SamplingRunner(ScriptedRunner):
    """Every sampling chunk gets the same logits (token 7 most likely) through
    the real sampler; a request named in `poison` makes execute raise."""

    def __init__(self, poison: frozenset[str] = frozenset()):
        super().__init__({})
        self.poison = poison
        self.calls: list[list[str]] = []

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        ids = [c.request.request_id for c in sched.chunks]
        self.calls.append(ids)
        if self.poison & set(ids):
            raise ValueError("simulated failure for a poisoned request")
        sampled = [c.request for c in sched.chunks if c.sample]
        logits = torch.zeros(len(sampled), VOCAB)
        logits[:, 7] = 5.0
        tokens = self.sampler(logits, sampled)
        return RunnerOutput({r.request_id: t for r, t in zip(sampled, tokens, strict=True)})


def make_core(runner: SamplingRunner) -> EngineCore:
    config = EngineConfig.from_flat(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=64)
    return EngineCore(config, as_runner(runner), NUM_BLOCKS, max_model_len=64)


def request(rid: str, prompt=(1, 2, 3, 4, 5), **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt), SamplingParams(**{"max_tokens": 2, "temperature": 0.0, **params}))


def poisoned_seed(rid: str) -> EngineCoreRequest:
    """A seed no torch.Generator takes, as if it had slipped past validation."""
    msg = request(rid, temperature=1.0, seed=1)
    msg.sampling_params.seed = 2**70
    return msg


def test_a_request_the_engine_cannot_seed_fails_alone_and_the_next_is_served():
    runner = SamplingRunner()
    core = make_core(runner)
    sent: list[StepResult] = []
    loop = EngineLoop(core, lambda timeout: [], sent.append, lambda: True)
    loop.handle([AddRequest(poisoned_seed("bad")), AddRequest(request("good"))])
    refused = sent[0].outputs.outputs
    assert [(o.request_id, o.finish_reason) for o in refused] == [("bad", "error")]
    assert "Overflow" in refused[0].error
    loop.step()
    loop.step()
    outputs = [o for result in sent[1:] for o in result.outputs.outputs]
    assert outputs == [EngineCoreOutput("good", [7]), EngineCoreOutput("good", [7], finish_reason="length")]
    assert not core.has_unfinished() and core.stats().kv_blocks_used == 0


def test_a_step_that_raises_is_pinned_on_the_request_at_fault():
    runner = SamplingRunner(poison=frozenset({"p"}))
    core = make_core(runner)
    for rid in ("a", "p", "b", "c"):
        core.add_request(request(rid, prompt=(10 + ord(rid), 2, 3, 4, 5)))
    first = core.step()
    by_id = {o.request_id: o for o in first.outputs}
    assert by_id["p"].finish_reason == "error" and "simulated failure" in by_id["p"].error
    assert [by_id[r].new_token_ids for r in ("a", "b", "c")] == [[7], [7], [7]]
    assert runner.calls[0] == ["a", "p", "b", "c"]  # the whole batch, then halves until "p" stands alone
    assert ["p"] in runner.calls and ["a"] in runner.calls
    assert "p" not in core.scheduler.requests and "p" in runner.sampler.forgotten
    second = core.step()
    assert sorted((o.request_id, o.finish_reason) for o in second.outputs) == [
        ("a", "length"), ("b", "length"), ("c", "length")]
    assert runner.calls[-1] == ["a", "b", "c"]
    assert core.stats().kv_blocks_used == 0


def test_a_failed_requests_blocks_leave_the_prefix_cache():
    runner = SamplingRunner(poison=frozenset({"p"}))
    core = make_core(runner)
    core.add_request(request("ok", prompt=(9, 9, 9, 9, 1)))
    core.add_request(request("p", prompt=(5, 6, 7, 8, 1)))  # its first block is published on allocation
    core.step()
    again = Request("q", [5, 6, 7, 8, 2], SamplingParams())
    assert core.kv.find_prefix(again).num_tokens == 0  # never written: not findable
    ok_again = Request("r", [9, 9, 9, 9, 2], SamplingParams())
    assert core.kv.find_prefix(ok_again).num_tokens == BLOCK_SIZE


def test_a_step_in_which_every_request_fails_is_the_engines_failure():
    runner = SamplingRunner(poison=frozenset({"a", "b"}))
    core = make_core(runner)
    core.add_request(request("a"))
    core.add_request(request("b"))
    try:
        core.step()
    except ValueError:
        pass
    else:
        raise AssertionError("a step that fails for every request must raise")


def test_a_lone_failing_request_is_its_own_failure():
    runner = SamplingRunner(poison=frozenset({"a"}))
    core = make_core(runner)
    core.add_request(request("a"))
    assert [(o.request_id, o.finish_reason) for o in core.step().outputs] == [("a", "error")]
    core.add_request(request("b"))
    assert core.step().outputs == [EngineCoreOutput("b", [7])]


def test_top_k_past_the_device_integer_keeps_the_whole_vocabulary():
    sampler = Sampler("cpu")
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    huge = SamplingParams(temperature=1.0, seed=3, max_tokens=1)
    huge.top_k = 9223372036854775808  # past int64, as if it had slipped past validation
    plain = SamplingParams(temperature=1.0, seed=3, max_tokens=1, top_k=VOCAB)
    draws = []
    for params in (huge, plain):
        fresh = Sampler("cpu")
        draws.append([fresh(logits, [Request("r", [1], params)])[0].token_id for _ in range(5)])
    assert draws[0] == draws[1]
    assert len(sampler(logits, [Request("s", [1], huge)])) == 1


class PoolingRunner(SamplingRunner):
    """Pools embedding requests with the real Pooler (hidden row = its position,
    so a mean-pooled prompt of n tokens is (n - 1) / 2) before a poisoned
    request makes the step raise: a failed step leaves a partial sum behind."""

    supports_prompt_outputs = True

    def __init__(self, poison: frozenset[str] = frozenset()):
        super().__init__(poison)
        self.pooler = Pooler()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        embeddings = {}
        for c in sched.chunks:
            if c.request.pooling is not None:
                hidden = torch.arange(c.start, c.start + c.num_tokens, dtype=torch.float32).unsqueeze(1)
                vector = self.pooler.add(c.request, hidden, c.start, c.sample)
                if vector is not None:
                    embeddings[c.request.request_id] = vector
        out = super().execute(SchedulerOutput([c for c in sched.chunks if c.request.pooling is None]))
        out.embeddings = embeddings
        return out


def test_a_chunk_re_run_after_a_failed_step_is_pooled_once():
    runner = PoolingRunner(poison=frozenset({"p"}))
    config = EngineConfig.from_flat(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=8)
    core = EngineCore(config, as_runner(runner), NUM_BLOCKS, max_model_len=64)
    core.add_request(EngineCoreRequest("e", list(range(1, 13)), SamplingParams(max_tokens=1), pooling="mean"))
    assert core.step().outputs == []  # e's first 8 prompt tokens
    core.add_request(request("p"))
    outputs = {o.request_id: o for o in core.step().outputs}  # e's last 4 tokens and p's first 4: raises
    assert outputs["p"].finish_reason == "error" and not outputs["p"].invalid
    assert outputs["e"].embedding == [5.5]  # mean of positions 0..11, its second chunk counted once


def test_a_feature_the_engine_lacks_fails_the_request_as_its_own_input():
    core = make_core(SamplingRunner())  # no prompt outputs (as under TP/PP), no grammar backend
    sent: list[StepResult] = []
    loop = EngineLoop(core, lambda timeout: [], sent.append, lambda: True)
    loop.handle([AddRequest(request("lp", prompt_logprobs=1)),
                 AddRequest(request("g", structured=GrammarSpec("regex", "a+")))])
    refused = {o.request_id: o for o in sent[0].outputs.outputs}
    assert (refused["lp"].invalid, refused["lp"].error_param) == (True, "prompt_logprobs")
    assert (refused["g"].invalid, refused["g"].error_param) == (True, "response_format")
    assert all(o.finish_reason == "error" for o in refused.values()) and not core.has_unfinished()
