"""Speculative decoding end to end: greedy output is token-for-token the
plain output, the KV cache holds exactly the verified tokens afterwards, and
the pool returns to idle."""
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.llm.engine.messages import EngineCoreRequest
from kiln.llm.kv_cache.manager import cdiv
from tests.integration.llm.bench_text import mixed_prompts

NUM_TOKENS = 24
# The default 1 GiB pool is slow to build for a tiny model; fp32 whatever `--dtype auto` picks on this CPU.
POOL = dict(num_blocks=1024, dtype="float32")


def assert_idle(llm):
    core = llm.engine.core
    assert not core.has_unfinished()
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in core.kv.pool.blocks)
    proposer = core.runner.proposer
    if proposer is not None and hasattr(proposer, "kv"):
        proposer.retain(set())
        assert proposer.kv.num_free_blocks == proposer.kv.pool.num_blocks


def repetitive_prompts(tokenizer, n):
    """Mixed lengths; half repeat a stretch of themselves, so n-gram lookup
    has something to propose from the prompt."""
    prompts = []
    for i, p in enumerate(mixed_prompts(tokenizer, n)):
        prompts.append(p + p[: 6 + i % 11] if i % 2 else p)
    return prompts


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return repetitive_prompts(smollm2_tokenizer, 24)


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir, prompts):
    llm = LLM(str(tiny_llama_dir), **POOL)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert_idle(llm)
    return outs


@pytest.mark.parametrize(
    "options",
    [
        dict(spec_method="ngram", num_speculative_tokens=4),
        dict(spec_method="ngram", num_speculative_tokens=3, ngram_min_n=2, max_num_batched_tokens=64),
        dict(spec_method="draft", num_speculative_tokens=3, draft_num_layers=1),
        dict(spec_method="ngram", num_speculative_tokens=5, num_blocks=40, block_size=16),  # preemption
        dict(spec_method="draft", num_speculative_tokens=2, num_blocks=40, block_size=16),
    ],
    ids=["ngram", "ngram-chunked", "draft", "ngram-preempt", "draft-preempt"],
)
def test_greedy_output_identical_with_speculation(tiny_llama_dir, prompts, plain_outputs, options):
    # Speculate in the full 24-request batch, not only in its tail (the
    # default switch-off is at 8 running requests).
    llm = LLM(str(tiny_llama_dir), max_batch_for_speculation=32, **{**POOL, **options})
    outs = llm.generate(prompts, GREEDY)
    for i, (out, ref) in enumerate(zip(outs, plain_outputs, strict=True)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
    stats = llm.engine.last_stats
    assert stats.spec_num_draft_tokens > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    if "num_blocks" in options:
        assert stats.num_preemptions > 0
    assert_idle(llm)


def test_a_draft_model_equal_to_the_target_is_accepted_in_a_mixed_batch(tiny_llama_dir, prompts, plain_outputs):
    # Its drafts went to the wrong requests once prompts of different lengths ran together
    # (the draft forward's logits rows came back in build_inputs' order): 14 of 357 accepted.
    llm = LLM(str(tiny_llama_dir), spec_method="draft", draft_model=str(tiny_llama_dir), num_speculative_tokens=4,
              max_batch_for_speculation=32, **POOL)
    outs = llm.generate(prompts[:8], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs[:8]
    stats = llm.engine.last_stats
    assert stats.spec_num_draft_tokens > 50
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens  # the same model: near-ties only
    assert_idle(llm)


def test_a_seeded_draw_is_the_same_with_speculation_and_in_any_batch(tiny_llama_dir, prompts):
    # With speculation on, a seeded sampled answer changed with the number of requests
    # running (drafting stops above max_batch_for_speculation, and rejection sampling
    # draws otherwise than the plain sampler): such a request is not speculated now.
    seeded = [SamplingParams(max_tokens=NUM_TOKENS, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(4)]
    greedy = [GREEDY] * 4
    plain = LLM(str(tiny_llama_dir), **POOL)
    alone = [plain.generate([p], s)[0].outputs[0].token_ids for p, s in zip(prompts[:4], seeded, strict=True)]
    spec = LLM(str(tiny_llama_dir), spec_method="draft", draft_num_layers=1, num_speculative_tokens=3,
               max_batch_for_speculation=32, **POOL)
    outs = spec.generate(prompts[:8], seeded + greedy)
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone
    assert spec.engine.last_stats.spec_num_draft_tokens > 0  # the greedy ones still speculate


def test_opt_out_and_batch_limit_disable_speculation(tiny_llama_dir, prompts, plain_outputs):
    llm = LLM(str(tiny_llama_dir), spec_method="ngram", max_batch_for_speculation=4, **POOL)
    opted_out = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, speculate=False)
    outs = llm.generate(prompts[:3], opted_out)
    assert llm.engine.last_stats.spec_num_draft_tokens == 0
    outs += llm.generate(prompts[3:], GREEDY)  # 21 running > 4: off until the batch drains
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert_idle(llm)


def test_sampling_with_speculation_runs_and_stays_in_range(tiny_llama_dir, prompts):
    llm = LLM(str(tiny_llama_dir), spec_method="draft", num_speculative_tokens=3, **POOL)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, repetition_penalty=1.1, ignore_eos=True)
    outs = llm.generate(prompts[:4], params)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert llm.engine.last_stats.spec_num_draft_tokens > 0
    assert_idle(llm)


def kv_rows(core, request_id, num_tokens):
    """[layers, 2, num_tokens, kv_heads, head_dim] KV of a running request."""
    bs = core.kv.block_size
    ids = core.kv.block_ids(request_id)
    slots = torch.tensor([ids[p // bs] * bs + p % bs for p in range(num_tokens)])
    return torch.stack([cache[:, slots] for cache in core.runner.kv_caches])


def test_kv_after_rejections_equals_a_fresh_prefill(tiny_llama_dir, prompts):
    llm = LLM(
        str(tiny_llama_dir), spec_method="draft", num_speculative_tokens=4, block_size=4, num_blocks=256,
        dtype="float32",
    )
    core = llm.engine.core
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest("spec", prompts[1], params))
    while core.scheduler.spec_stats.num_accepted_tokens == core.scheduler.spec_stats.num_draft_tokens or (
        core.scheduler.spec_stats.num_draft_tokens < 20
    ):
        core.step()
    request = core.scheduler.requests["spec"]
    n = request.num_computed_tokens
    assert n == request.num_tokens - 1
    # Exactly the verified tokens' blocks are held, and none is published past them.
    assert len(core.kv.tables["spec"]) == cdiv(request.num_tokens, 4)
    spec_kv = kv_rows(core, "spec", n)

    fresh = LLM(str(tiny_llama_dir), block_size=4, num_blocks=256, dtype="float32")
    fresh.engine.core.add_request(EngineCoreRequest("fresh", request.all_token_ids[: n + 1], params))
    fresh.engine.core.step()  # one prefill of all n + 1 tokens
    fresh_kv = kv_rows(fresh.engine.core, "fresh", n)
    torch.testing.assert_close(spec_kv, fresh_kv, atol=1e-4, rtol=1e-4)
    core.abort_requests(["spec"])
    fresh.engine.core.abort_requests(["fresh"])
    assert_idle(llm)
    assert_idle(fresh)


@pytest.mark.slow
def test_smollm2_ngram_on_input_grounded_prompts(make_smollm2_engine, smollm2_tokenizer):
    from pydoc_data.topics import topics

    words = topics["if"].split()
    prompts = [
        smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": "Repeat the following text exactly:\n\n" + " ".join(words[i : i + 40])}],
            add_generation_prompt=True,
        )
        for i in (0, 15, 30, 45)
    ]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = make_smollm2_engine(kv_cache_memory_gib=0.1).generate(prompts, params)
    llm = make_smollm2_engine(kv_cache_memory_gib=0.1, spec_method="ngram", num_speculative_tokens=4, ngram_min_n=2)
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.last_stats
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens // 4  # copying: most drafts hit
    assert_idle(llm)
