"""EngineCore's step loop (schedule -> execute -> update) on a scripted fake
runner: exact chunks, outputs, stats, aborts, and the sampler told to forget
every request that leaves the core."""
from __future__ import annotations

from kiln.config import EngineConfig
from kiln.llm.engine.core import EngineCore
from kiln.llm.engine.messages import EngineCoreOutput, EngineCoreRequest
from kiln.llm.outputs import TokenLogprob
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling_params import SamplingParams
from tests.unit.llm.engine.fakes import ScriptedRunner, as_runner

EOS = 99
NUM_BLOCKS, BLOCK_SIZE, BUDGET = 8, 4, 8


def make_core(script, caching=True) -> tuple[EngineCore, ScriptedRunner]:
    config = EngineConfig.from_flat(
        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET, enable_prefix_caching=caching
    )
    runner = ScriptedRunner(script)
    return EngineCore(config, as_runner(runner), NUM_BLOCKS, max_model_len=64), runner


def add(core, rid, prompt, max_tokens=3, **params):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    core.add_request(EngineCoreRequest(rid, list(prompt), params, eos_token_ids=(EOS,)))


def test_one_request_prefill_then_decodes_until_length():
    core, runner = make_core({"a": [10, 11, 12]})
    add(core, "a", range(1, 7))
    first = core.step()
    assert first.outputs == [EngineCoreOutput("a", [10])]
    s = first.stats
    assert (s.num_running, s.num_waiting, s.kv_blocks_used, s.kv_blocks_total) == (1, 0, 2, NUM_BLOCKS)
    assert (s.num_scheduled_tokens, s.num_scheduled_seqs, s.prefix_cache_queries, s.prefix_cache_hits) == (6, 1, 6, 0)
    assert core.step().outputs == [EngineCoreOutput("a", [11])]
    assert runner.sampler.forgotten == []
    last = core.step()
    assert last.outputs == [EngineCoreOutput("a", [12], finish_reason="length")]
    assert runner.steps == [[("a", 0, 6)], [("a", 6, 1)], [("a", 7, 1)]]
    assert runner.sampler.forgotten == ["a"]  # finished: its generator state is dropped
    assert (last.stats.num_running, last.stats.kv_blocks_used) == (0, 0)
    assert not core.has_unfinished()
    idle = core.step()  # nothing scheduled: the runner is not called
    assert idle.outputs == [] and len(runner.steps) == 3


def test_two_requests_share_the_token_budget_with_a_chunked_prefill():
    core, runner = make_core({"a": [10, 11], "b": [20, 21]})
    add(core, "a", range(1, 7), max_tokens=2)
    add(core, "b", range(30, 35), max_tokens=2)
    step1 = core.step()
    assert step1.outputs == [EngineCoreOutput("a", [10])]  # b's first chunk samples nothing
    assert (step1.stats.num_scheduled_tokens, step1.stats.num_scheduled_seqs) == (8, 2)
    step2 = core.step()
    assert step2.outputs == [EngineCoreOutput("a", [11], finish_reason="length"), EngineCoreOutput("b", [20])]
    step3 = core.step()
    assert step3.outputs == [EngineCoreOutput("b", [21], finish_reason="length")]
    assert runner.steps == [[("a", 0, 6), ("b", 0, 2)], [("a", 6, 1), ("b", 2, 3)], [("b", 5, 1)]]
    assert runner.sampler.forgotten == ["a", "b"]


def test_a_stop_token_finishes_with_its_id():
    core, runner = make_core({"a": [10, EOS]})
    add(core, "a", [1, 2, 3], max_tokens=8)
    core.step()
    assert core.step().outputs == [EngineCoreOutput("a", [EOS], finish_reason="stop", stop_token_id=EOS)]
    assert runner.sampler.forgotten == ["a"]


def test_abort_frees_blocks_and_is_forgotten_once():
    core, runner = make_core({"a": [10, 11], "b": []})
    add(core, "a", range(1, 7), max_tokens=5)
    add(core, "b", range(40, 50), max_tokens=5)
    assert core.step().outputs == [EngineCoreOutput("a", [10])]  # b: a 2-token chunk, nothing sampled
    core.abort_requests(["a"])
    core.abort_requests(["a", "unknown"])  # already gone / never seen: nothing to forget
    assert runner.sampler.forgotten == ["a"]
    core.abort_requests(["b"])  # running with a partial prefill
    assert runner.sampler.forgotten == ["a", "b"]
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert not core.has_unfinished()
    assert core.step().outputs == []


def test_logprobs_of_the_sampled_token_pass_through():
    top = [(10, -0.5), (7, -1.5)]
    core, _ = make_core({"a": [SampledToken(10, -0.5, top)]})
    add(core, "a", [1, 2, 3], max_tokens=1)
    (out,) = core.step().outputs
    assert out.new_logprobs == [TokenLogprob(10, -0.5, top)]
    assert out.finish_reason == "length"


def test_a_repeated_prompt_hits_the_prefix_cache():
    core, runner = make_core({"a": [10], "b": [20]})
    add(core, "a", range(1, 10), max_tokens=1)
    assert core.step().outputs == []  # 8 of 9 prompt tokens: the budget
    assert core.step().outputs == [EngineCoreOutput("a", [10], finish_reason="length")]
    add(core, "b", range(1, 10), max_tokens=1)
    out = core.step()
    assert out.outputs == [EngineCoreOutput("b", [20], finish_reason="length", num_cached_tokens=8)]
    # two full blocks come from the cache; the last prompt token is computed to sample after it
    assert runner.steps == [[("a", 0, 8)], [("a", 8, 1)], [("b", 8, 1)]]
    assert (out.stats.prefix_cache_queries, out.stats.prefix_cache_hits) == (18, 8)


def test_stats_outside_a_step_count_no_step_and_shutdown_reaches_the_runner():
    core, runner = make_core({"a": [10, 11]})
    add(core, "a", [1, 2, 3])
    core.step()
    stats = core.stats()
    assert (stats.num_running, stats.num_scheduled_tokens, stats.num_scheduled_seqs, stats.step_seconds) == (1, 0, 0, 0)
    core.check_health()
    core.shutdown()
    assert runner.closed
