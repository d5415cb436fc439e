"""Scheduler tests with a fake runner: exact token budgets and block ids."""
import zlib

import pytest

from kiln.config import SchedulerConfig
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.request import Request, RequestStatus
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler.output import RunnerOutput
from kiln.llm.scheduler.scheduler import Scheduler

BS = 4
EOS = 999


class FakeRunner:
    """Next token = a hash of the whole history, like a deterministic model.
    Checks that every fed position lies in an allocated block."""

    def __init__(self, kv):
        self.kv = kv
        self.steps = []

    def execute(self, sched):
        out = RunnerOutput()
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in sched.chunks])
        for c in sched.chunks:
            assert len(c.block_ids) * BS >= c.start + c.num_tokens
            if c.sample:
                history = c.request.all_token_ids
                out.sampled[c.request.request_id] = SampledToken(zlib.crc32(bytes(str(history), "ascii")) % 500)
        return out


def make(num_blocks=64, budget=32, max_seqs=8, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, max_model_len=4096)
    return sched, kv, FakeRunner(kv)


def req(rid, n_prompt, max_tokens=5, base=0):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [base + i for i in range(n_prompt)], params, (EOS,))


def run(sched, runner, max_steps=1000):
    per_step = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        per_step.append(out)
        sched.update(out, runner.execute(out))
    assert not sched.has_unfinished()
    return per_step


def assert_idle(kv):
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.tables == {}


def test_budget_is_respected_and_prefill_is_chunked():
    sched, kv, runner = make(budget=32)
    r = req("long", 100, max_tokens=3)
    sched.add_request(r)
    steps = run(sched, runner)
    assert [s.num_tokens for s in steps] == [32, 32, 32, 4, 1, 1]
    assert runner.steps[3] == [("long", 96, 4)]
    assert r.num_output_tokens == 3 and r.status is RequestStatus.FINISHED_LENGTH
    assert_idle(kv)


def test_decodes_are_scheduled_before_a_long_prefill():
    sched, kv, runner = make(budget=16)
    short = req("short", 4, max_tokens=6)
    sched.add_request(short)
    sched.update(first := sched.schedule(), runner.execute(first))  # short prefilled, has 1 token
    long = req("long", 40, max_tokens=2, base=100)
    sched.add_request(long)
    for _ in range(3):
        out = sched.schedule()
        ids = [(c.request.request_id, c.num_tokens) for c in out.chunks]
        assert ids[0] == ("short", 1)  # the decode always gets its slot
        assert sum(n for _, n in ids) <= 16
        sched.update(out, runner.execute(out))
    run(sched, runner)
    assert_idle(kv)


def test_max_num_seqs_limits_admission():
    sched, kv, runner = make(budget=64, max_seqs=2)
    for i in range(4):
        sched.add_request(req(f"r{i}", 4, base=10 * i))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    sched.update(out, runner.execute(out))
    run(sched, runner)
    assert_idle(kv)


def test_finished_requests_free_blocks_and_new_ones_join_next_step():
    sched, kv, runner = make(budget=64)
    a = req("a", 4, max_tokens=1)
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert a.is_finished and kv.num_free_blocks == 64
    b = req("b", 4, max_tokens=2, base=50)
    sched.add_request(b)
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["b"]
    sched.update(out, runner.execute(out))
    run(sched, runner)
    assert_idle(kv)


def reference_outputs(requests):
    sched, kv, runner = make(num_blocks=256, budget=64)
    for r in requests:
        sched.add_request(r)
    run(sched, runner)
    return {r.request_id: r.output_token_ids for r in requests}


def fresh(n):
    return [req(f"r{i}", 6 + 3 * i, max_tokens=12, base=100 * i) for i in range(n)]


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_resumes_with_identical_output(caching):
    expected = reference_outputs(fresh(6))
    sched, kv, runner = make(num_blocks=10, budget=64, caching=caching)
    requests = fresh(6)
    for r in requests:
        sched.add_request(r)
    run(sched, runner)
    assert sched.num_preemptions > 0
    assert {r.request_id: r.output_token_ids for r in requests} == expected
    assert_idle(kv)


def test_most_recently_admitted_is_preempted_first():
    # Two requests of 4 prompt tokens each fill 2 blocks; the third block is
    # needed by both at their 5th token. The later one (b) must be evicted.
    sched, kv, runner = make(num_blocks=3, budget=64)
    a, b = req("a", 4, max_tokens=6), req("b", 4, max_tokens=6, base=50)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert kv.block_ids("a") == [0] and kv.block_ids("b") == [1]
    out = sched.schedule()  # a takes block 2, b needs a block too -> b preempted
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert out.preempted_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b]
    sched.update(out, runner.execute(out))
    run(sched, runner)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert_idle(kv)


def test_abort_frees_everything_at_once():
    sched, kv, runner = make(budget=8)
    a, b = req("a", 20, max_tokens=50), req("b", 4, max_tokens=50, base=40)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert sched.abort("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("a") is None  # idempotent
    assert sched.abort("b") is b  # still waiting: removed from the queue
    assert not sched.has_unfinished()
    assert_idle(kv)


def test_stop_on_eos_and_stop_token_ids():
    sched, kv, runner = make()

    class Eos(FakeRunner):
        def execute(self, s):
            out = RunnerOutput()
            for c in s.chunks:
                if c.sample:
                    n = c.request.num_output_tokens
                    out.sampled[c.request.request_id] = SampledToken(EOS if n == 2 else 7 if n == 1 else 1)
            return out

    params_eos = SamplingParams(max_tokens=10)
    params_stop = SamplingParams(max_tokens=10, stop_token_ids=[7])
    params_min = SamplingParams(max_tokens=10, min_tokens=4)
    a = Request("a", [1, 2], params_eos, (EOS,))
    b = Request("b", [1, 2], params_stop, (EOS,))
    c = Request("c", [1, 2], params_min, (EOS,))
    for r in (a, b, c):
        sched.add_request(r)
    run(sched, Eos(kv))
    assert a.output_token_ids == [1, 7, EOS] and a.finish_reason == "stop" and a.stop_token_id == EOS
    assert b.output_token_ids == [1, 7] and b.stop_token_id == 7
    # min_tokens: eos before 4 tokens does not stop (the sampler also masks it)
    assert c.num_output_tokens >= 4
    assert_idle(kv)


def test_prefix_hits_are_counted_once_per_request():
    sched, kv, runner = make(budget=64)
    a = req("a", 12, max_tokens=1)
    sched.add_request(a)
    run(sched, runner)
    b = req("b", 12, max_tokens=1)  # same prompt
    sched.add_request(b)
    run(sched, runner)
    assert b.num_cached_tokens == 8  # 2 of 3 blocks; the last token is recomputed
    assert kv.stats.queries == 24 and kv.stats.hits == 8
    assert_idle(kv)
