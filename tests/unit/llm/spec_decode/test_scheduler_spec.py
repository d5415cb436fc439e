"""Scheduler + KV manager with drafts in flight, with a fake runner whose
'model' is a hash of the history, so which drafts are accepted is exact."""
import zlib

from kiln.config import SchedulerConfig
from kiln.llm.kv_cache.hashing import hash_full_blocks
from kiln.llm.kv_cache.manager import KVCacheManager
from kiln.llm.request import Request, RequestStatus
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler.output import RunnerOutput
from kiln.llm.scheduler.scheduler import Scheduler
from kiln.llm.spec_decode.rejection import greedy_accept

BS = 4
EOS = 999


def model(history):
    return zlib.crc32(bytes(str(history), "ascii")) % 500


class FakeSpecRunner:
    """Greedy 'model' over the history; drafts verified with greedy_accept."""

    def __init__(self):
        self.steps = []

    def execute(self, sched):
        out = RunnerOutput()
        self.steps.append([(c.request.request_id, c.start, c.num_tokens) for c in sched.chunks])
        for c in sched.chunks:
            assert len(c.block_ids) * BS >= c.start + c.num_tokens
            if not c.sample:
                continue
            history = c.request.all_token_ids
            if c.draft_token_ids:
                seqs = [history + c.draft_token_ids[:i] for i in range(len(c.draft_token_ids) + 1)]
                tokens = greedy_accept([model(s) for s in seqs], c.draft_token_ids)
                out.spec_sampled[c.request.request_id] = [SampledToken(t) for t in tokens]
            else:
                out.sampled[c.request.request_id] = SampledToken(model(history))
        return out


def make(num_blocks=64, budget=32, max_seqs=8, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, max_model_len=4096)
    return sched, kv, FakeSpecRunner()


def req(rid, n_prompt, max_tokens=12, **params):
    params.setdefault("ignore_eos", True)
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens, **params), (EOS,))


def true_continuation(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(model(seq))
    return seq[len(prompt):]


def step(sched, runner):
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    return out


def assert_idle(kv):
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.tables == {}


def oracle_drafts(request, n_good, n_bad):
    """n_good correct next tokens, then n_bad wrong ones."""
    good = true_continuation(request.all_token_ids, n_good)
    return good + [(t + 1) % 500 for t in true_continuation(request.all_token_ids + good, n_bad)]


def test_drafts_are_scheduled_within_budget_and_accepted_tokens_appended():
    sched, kv, runner = make(budget=8)
    r = req("a", 6)
    sched.add_request(r)
    step(sched, runner)  # prefill: 6 tokens, first output
    assert r.num_output_tokens == 1
    r.spec_token_ids = oracle_drafts(r, 2, 8)  # 10 drafts, budget 8 -> 7 verified
    r_first_drafts = r.spec_token_ids[:7]
    out = step(sched, runner)
    drafts = out.chunks[0].draft_token_ids
    assert out.num_tokens == 8 and drafts == r_first_drafts
    # 2 accepted + 1 correction
    assert r.num_output_tokens == 4
    assert r.output_token_ids == true_continuation(r.prompt_token_ids, 4)
    assert r.num_computed_tokens == r.num_tokens - 1
    assert sched.spec_stats.num_draft_tokens == 7 and sched.spec_stats.num_accepted_tokens == 2
    assert sched.spec_stats.accepted_per_position == [1, 1, 0, 0, 0, 0, 0]


def test_rejected_drafts_blocks_are_rolled_back():
    sched, kv, runner = make(num_blocks=16, budget=32)
    r = req("a", 7)  # 7 prompt tokens -> 2 blocks
    sched.add_request(r)
    step(sched, runner)  # 8 tokens in all, computed 7
    free_before = kv.num_free_blocks
    r.spec_token_ids = oracle_drafts(r, 0, 9)  # all wrong: positions 8..16 need 3 more blocks
    out = step(sched, runner)
    assert out.chunks[0].num_tokens == 10
    assert r.num_tokens == 9 and r.num_computed_tokens == 8
    # only blocks holding tokens remain: cdiv(9, 4) = 3
    assert len(kv.tables["a"]) == 3
    assert kv.num_free_blocks == free_before - 1
    # published hashes cover verified tokens only
    hashes = hash_full_blocks(r.all_token_ids, BS, [])
    for block, h in zip(kv.tables["a"], hashes, strict=False):
        assert block.block_hash in (None, h)
    assert all(b.block_hash is None for b in kv.tables["a"][len(hashes):])


def test_no_block_with_a_draft_token_is_published():
    sched, kv, runner = make(num_blocks=16, budget=32)
    r = req("a", 3)
    sched.add_request(r)
    step(sched, runner)  # 4 tokens, computed 3
    r.spec_token_ids = oracle_drafts(r, 0, 8)
    sched.schedule()  # positions 3..11 allocated; only block 0 (tokens 0..3) is all verified
    published = [b for b in kv.tables["a"] if b.block_hash is not None]
    assert published == kv.tables["a"][:1]


def test_stop_token_inside_accepted_drafts_truncates():
    sched, kv, runner = make()
    prompt_len = 5
    r = req("a", prompt_len, max_tokens=20)
    truth = true_continuation(list(range(prompt_len)), 6)
    r.sampling_params.stop_token_ids = [truth[3]]
    sched.add_request(r)
    step(sched, runner)
    r.spec_token_ids = truth[1:6]  # all correct; the stop token is the 3rd draft
    step(sched, runner)
    assert r.output_token_ids == truth[:4]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_token_id == truth[3]
    assert_idle(kv)


def test_max_tokens_inside_accepted_drafts_truncates():
    sched, kv, runner = make()
    r = req("a", 5, max_tokens=3)
    sched.add_request(r)
    step(sched, runner)
    r.spec_token_ids = true_continuation(r.all_token_ids, 4)
    step(sched, runner)
    assert r.output_token_ids == true_continuation(list(range(5)), 3)
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert_idle(kv)


def run_with_drafts(sched, runner, requests, n_good, n_bad, max_steps=500):
    for r in requests:
        sched.add_request(r)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        for r in sched.running:
            if r.num_computed_tokens == r.num_tokens - 1:
                r.spec_token_ids = oracle_drafts(r, n_good, n_bad)
        step(sched, runner)
    assert not sched.has_unfinished()


def test_outputs_equal_plain_decoding_and_pool_idle_with_preemption():
    sched, kv, runner = make(num_blocks=14, budget=16, max_seqs=4)
    requests = [req(f"r{i}", 3 + 3 * i, max_tokens=10) for i in range(5)]
    run_with_drafts(sched, runner, requests, n_good=2, n_bad=2)
    for r in requests:
        assert r.output_token_ids == true_continuation(r.prompt_token_ids, 10), r.request_id
    assert sched.num_preemptions > 0
    assert_idle(kv)


def test_abort_with_drafts_in_flight():
    sched, kv, runner = make()
    r = req("a", 6)
    sched.add_request(r)
    step(sched, runner)
    r.spec_token_ids = oracle_drafts(r, 1, 2)
    out = sched.schedule()
    sched.abort("a")
    sched.update(out, runner.execute(out))  # result for an aborted request is ignored
    assert r.status is RequestStatus.FINISHED_ABORTED and r.spec_token_ids == []
    assert_idle(kv)
