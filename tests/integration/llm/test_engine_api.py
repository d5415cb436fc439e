"""The offline LLM and engine APIs on a tiny random-weight Llama."""
import math

import pytest

from kiln import LLM, SamplingParams
from kiln.errors import ConfigError, InvalidRequestError, ModelLoadError, PromptTooLongError

PROMPTS = ["Hello there", "The quick brown fox", "1, 2, 3,", "def f(x):"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), kv_cache_memory_gib=0.02, max_model_len=256)


def idle(llm):
    core = llm.engine.core
    return not core.has_unfinished() and core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_outputs_in_input_order_with_exact_lengths(llm):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 1, 5)]
    outs = llm.generate(PROMPTS, params)
    assert [o.prompt for o in outs] == PROMPTS
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 1, 5]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    assert idle(llm)


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate(["Hello there"], seeded)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate(PROMPTS + ["Hello there"], [others] * 4 + [seeded])
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True)
    assert llm.generate(["Hello there"], other_seed)[0].outputs[0].token_ids != alone


def test_stop_string_truncates_text(llm):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate(["Once upon a time"], greedy)[0].outputs[0].text
    assert len(full) > 12
    stop = full[8:12]
    first = full.find(stop)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    out = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert out.text == full[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    params.include_stop_str_in_output = True
    out = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert out.text == full[: first + len(stop)]
    assert idle(llm)


def test_streamed_deltas_concatenate_to_the_final_text(llm):
    engine = llm.engine
    engine.add_request("s1", "Streaming works", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    pieces, ids, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.delta_text)
            ids.extend(out.delta_token_ids)
            last = out
    assert last.finished and "".join(pieces) == last.outputs[0].text
    assert ids == last.outputs[0].token_ids
    assert llm.tokenizer.decode(ids) == last.outputs[0].text


def test_logprobs(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    out = llm.generate(["Hello"], params)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the top one
        assert math.isclose(lp.top[0][1], lp.logprob, rel_tol=1e-6)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("a1", "abort me " * 20, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.core.kv.num_free_blocks < engine.core.kv.pool.num_blocks
    engine.abort(["a1"])
    assert idle(llm)
    assert engine.step() == []


def test_vllm_prompt_dicts_are_their_text_or_token_ids(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = llm.engine.inputs.tokenizer.encode("Hello there")
    by_text, by_ids, one = llm.generate(["Hello there", [*ids], {"prompt": "Hello there"}], greedy)
    as_dicts = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], greedy)
    single = llm.generate({"prompt_token_ids": ids}, greedy)  # one dict is one prompt, not its keys
    expected = by_text.outputs[0].token_ids
    assert by_ids.outputs[0].token_ids == one.outputs[0].token_ids == expected
    assert [o.outputs[0].token_ids for o in as_dicts + single] == [expected] * 3
    assert as_dicts[0].prompt == "Hello there" and single[0].prompt_token_ids == ids
    assert idle(llm)


@pytest.mark.parametrize("prompt,message", [
    ({"prompt": "hi", "prompt_token_ids": [1]}, "2 of them"),
    ({}, "0 of them"),
    ({"prompt": "hi", "multi_modal_data": {}}, r"unsupported keys \['multi_modal_data'\]"),
    ({"prompt": [1, 2]}, "'prompt' must be text; got list"),
    ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list of token ids; got str"),
    ({"prompt_token_ids": []}, "empty"),
    (b"hi", "got bytes"),
    (3.5, "got float"),  # ([7] is the one-token prompt 7)
    (None, "got NoneType"),
])
def test_a_malformed_prompt_is_rejected_by_name(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert idle(llm)


def test_bad_requests_are_rejected_before_the_engine(llm):
    with pytest.raises(PromptTooLongError, match="256"):
        llm.generate(["word " * 400], SamplingParams(max_tokens=4))
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=1000))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[1, 2, 10**9]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="token ids"):  # True is an int to isinstance
        llm.generate([[True, False, 504]], SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"pooling must be one of \['last', 'mean'\], got 'max'"):
        llm.embed(["hi"], pooling="max")
    assert idle(llm)


def test_a_refused_prompt_leaves_none_of_its_batch_queued(llm):
    # The good prompts before the bad one were added and left queued: the next call
    # ran them all first (5 s for a one-token answer), holding their KV blocks meanwhile.
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate(["a valid prompt"] * 8 + [[10**9]], SamplingParams(max_tokens=200))
    assert idle(llm) and not llm.engine.has_unfinished()
    with pytest.raises(InvalidRequestError):
        llm.embed(["fine", ""])
    assert idle(llm) and not llm.engine.has_unfinished()
    (out,) = llm.generate(["hi"], SamplingParams(max_tokens=1))
    assert len(out.outputs[0].token_ids) == 1


def test_config_and_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown engine option 'bogus'"):
        LLM(str(tmp_path), bogus=1)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(str(tmp_path), dtype="int3")
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        LLM(str(tmp_path))


def test_a_path_object_names_the_model_as_its_text_does(llm, tiny_llama_dir):
    by_path = LLM(tiny_llama_dir, kv_cache_memory_gib=0.02, max_model_len=256)
    assert by_path.config.model.model == str(tiny_llama_dir)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in by_path.generate(PROMPTS, params)] == [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)
    ]


def test_without_chunked_prefill_a_request_fits_one_step(tiny_llama_dir):
    # Unchunked, a prompt longer than the step budget could never be scheduled (it
    # hung the engine, and every request queued behind it): the context is capped
    # to the budget, so such a prompt is refused up front; an explicit longer
    # max_model_len is a configuration error.
    llm = LLM(str(tiny_llama_dir), kv_cache_memory_gib=0.02, enable_chunked_prefill=False, max_num_batched_tokens=32)
    assert llm.engine.max_model_len == 32
    with pytest.raises(PromptTooLongError):
        llm.generate([list(range(100, 140))], SamplingParams(max_tokens=4))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [len(o.outputs[0].token_ids) for o in llm.generate([list(range(100, 120))] * 3, params)] == [8, 8, 8]
    assert idle(llm)
    with pytest.raises(ConfigError, match="max_model_len 256 exceeds max_num_batched_tokens 32"):
        LLM(str(tiny_llama_dir), kv_cache_memory_gib=0.02, enable_chunked_prefill=False, max_num_batched_tokens=32,
            max_model_len=256)


def test_step_budget_default_and_override(llm, tiny_llama_dir):
    from kiln.config import SchedulerConfig

    # The offline LLM takes the server's default step budget; a value the caller gives wins.
    assert llm.config.scheduler.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens == 2048
    small = LLM(str(tiny_llama_dir), kv_cache_memory_gib=0.02, max_model_len=256, max_num_batched_tokens=16)
    assert small.config.scheduler.max_num_batched_tokens == 16
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS, params)] == [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)
    ]


def test_the_offline_llm_faults_its_kv_pool_in_when_built(llm, tiny_llama_dir, caplog):
    # No idle time to warm it in later: the pool is resident before generate()
    # runs (nothing left to warm), unless warming is off (all of it left).
    assert llm.engine.core.runner.warm_kv_pool() is False
    lazy = LLM(str(tiny_llama_dir), kv_cache_memory_gib=0.02, max_model_len=256, warm_kv_pool=False)
    assert lazy.engine.core.runner.warm_kv_pool() is True
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in lazy.generate(PROMPTS, params)] == [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)
    ]
    with caplog.at_level("INFO", logger="kiln.llm.llm"):
        LLM(str(tiny_llama_dir), kv_cache_memory_gib=0.02, max_model_len=256)
    assert any("KV pool faulted in" in r.getMessage() for r in caplog.records)


def test_a_prefill_only_request_may_fill_the_context(llm):
    # An embedding or a scored prompt never holds a position for a token of its own:
    # a prompt of exactly max_model_len was refused as if it did.
    full = [100 + i % 500 for i in range(llm.engine.max_model_len)]
    (vector,) = llm.embed([full])
    assert len(vector) > 0 and all(math.isfinite(v) for v in vector)
    (scored,) = llm.generate([full], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(scored.prompt_logprobs) == len(full) and scored.outputs[0].token_ids == []
    with pytest.raises(PromptTooLongError, match="maximum context length"):
        llm.embed([full + [100]])
    with pytest.raises(PromptTooLongError, match="must be shorter"):  # one that generates still needs room
        llm.generate([full], SamplingParams(max_tokens=1))
    assert idle(llm)
