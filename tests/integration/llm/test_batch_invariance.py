"""A request's greedy output must not depend on what else is in the batch,
on prefix caching, or on being preempted and recomputed."""
import pytest

from kiln import SamplingParams
from tests.integration.llm.bench_text import mixed_prompts

pytestmark = pytest.mark.slow
NUM_TOKENS = 24


def assert_idle(llm):
    core = llm.engine.core
    assert not core.has_unfinished()
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in core.kv.pool.blocks)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return mixed_prompts(smollm2_tokenizer, 16)


@pytest.fixture(scope="module")
def alone(make_smollm2_engine, prompts):
    llm = make_smollm2_engine(enable_prefix_caching=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outs = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert_idle(llm)
    return outs


@pytest.mark.parametrize(
    "options",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True, max_num_batched_tokens=64),  # chunked prefill
        dict(enable_prefix_caching=True, num_blocks=32, block_size=16),  # forces preemption
        dict(enable_prefix_caching=False, num_blocks=32, block_size=16),
    ],
    ids=["cache-on", "cache-off", "chunked", "preempt-cache-on", "preempt-cache-off"],
)
def test_batch_of_16_matches_alone(make_smollm2_engine, prompts, alone, options):
    llm = make_smollm2_engine(**options)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for i, (out, ref) in enumerate(zip(outs, alone, strict=True)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
    if "num_blocks" in options:
        assert llm.engine.last_stats.num_preemptions > 0
    assert_idle(llm)
