"""Priority scheduling on a fake runner: exact admission and preemption orders."""
import pytest

from kiln.config import SchedulerConfig
from kiln.errors import ConfigError
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.request import Request, RequestStatus
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler.scheduler import Scheduler
from tests.unit.llm.scheduler.test_scheduler import BS, EOS, FakeRunner, assert_idle, run


def make(policy="priority", num_blocks=64, budget=64, max_seqs=8, aging_s=0.0):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, scheduling_policy=policy, priority_aging_s=aging_s
    )
    return Scheduler(config, kv, max_model_len=4096), kv, FakeRunner(kv)


def req(rid, priority, arrival, n_prompt=4, max_tokens=3):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [7 + i for i in range(n_prompt)], params, (EOS,), arrival_time=arrival, priority=priority)


def admission_order(sched, runner):
    """Request ids in the order they were first scheduled."""
    order = []
    for step in run(sched, runner):
        for c in step.chunks:
            if c.request.request_id not in order:
                order.append(c.request.request_id)
    return order


def test_lower_priority_value_is_admitted_first_and_ties_stay_fcfs():
    sched, kv, runner = make(max_seqs=1)
    for rid, prio, t in [("a", 5, 0.0), ("b", 1, 1.0), ("c", 5, 2.0), ("d", 1, 3.0), ("e", -2, 4.0)]:
        sched.add_request(req(rid, prio, t))
    assert admission_order(sched, runner) == ["e", "b", "d", "a", "c"]
    assert_idle(kv)


def test_fcfs_ignores_priority():
    sched, kv, runner = make(policy="fcfs", max_seqs=1)
    for rid, prio, t in [("a", 5, 0.0), ("b", 1, 1.0), ("c", -3, 2.0)]:
        sched.add_request(req(rid, prio, t))
    assert admission_order(sched, runner) == ["a", "b", "c"]


def test_aging_bounds_starvation():
    # aging 10 s per level: a (prio 2, t=0) ranks like prio 0 at t=20, so it
    # goes before b (prio 0, t=25) but after c (prio 0, t=15).
    sched, kv, runner = make(max_seqs=1, aging_s=10.0)
    for rid, prio, t in [("a", 2, 0.0), ("b", 0, 25.0), ("c", 0, 15.0), ("d", 0, 19.9)]:
        sched.add_request(req(rid, prio, t))
    assert admission_order(sched, runner) == ["c", "d", "a", "b"]


def test_lowest_priority_running_request_is_preempted_first():
    # Three 4-token prompts fill 3 of 4 blocks; all need a 2nd block at their
    # 5th token. The high-priority value (worst) request goes, although it was
    # admitted first.
    sched, kv, runner = make(num_blocks=4)
    low, mid = req("low", 9, 0.0, max_tokens=6), req("mid", 5, 1.0, max_tokens=6)
    high = req("high", 0, 2.0, max_tokens=6)
    for r in (low, mid, high):
        sched.add_request(r)
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["high", "mid", "low"]
    sched.update(out, runner.execute(out))
    out = sched.schedule()
    assert out.preempted_ids == ["low"]
    assert [c.request.request_id for c in out.chunks] == ["high", "mid"]
    assert low.status is RequestStatus.PREEMPTED
    sched.update(out, runner.execute(out))
    run(sched, runner)
    assert all(r.num_output_tokens == 6 for r in (low, mid, high))
    assert_idle(kv)


def test_a_waiting_high_priority_request_displaces_a_lower_one():
    sched, kv, runner = make(max_seqs=1)
    low = req("low", 5, 0.0, max_tokens=8)
    sched.add_request(low)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    high = req("high", 1, 1.0, max_tokens=2)
    same = req("same", 5, 2.0, max_tokens=2)  # equal priority never displaces
    sched.add_request(high)
    sched.add_request(same)
    out = sched.schedule()
    assert out.preempted_ids == ["low"]
    assert [c.request.request_id for c in out.chunks] == ["high"]
    sched.update(out, runner.execute(out))
    order = admission_order(sched, runner)
    assert order == ["high", "low", "same"]  # low (preempted, earlier) before same
    assert_idle(kv)


def test_priority_displacement_when_the_pool_is_full():
    # low fills all 4 blocks (12 prompt tokens, then a decode); a better-ranked
    # prompt needs one block: low is preempted although a sequence slot is free.
    sched, kv, runner = make(num_blocks=4)
    low = req("low", 3, 0.0, n_prompt=12, max_tokens=4)
    sched.add_request(low)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    assert kv.num_free_blocks == 0 and low.num_output_tokens == 2
    high = req("high", 0, 1.0, n_prompt=4, max_tokens=1)
    sched.add_request(high)
    out = sched.schedule()
    assert out.preempted_ids == ["low"] and [c.request.request_id for c in out.chunks] == ["high"]
    sched.update(out, runner.execute(out))
    assert high.is_finished
    run(sched, runner)
    assert low.num_output_tokens == 4
    assert_idle(kv)


def test_policy_is_validated():
    with pytest.raises(ConfigError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ConfigError, match="priority_aging_s"):
        SchedulerConfig(priority_aging_s=-1.0)
