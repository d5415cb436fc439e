"""Engine correctness with quantized weights. Tolerance: none, in both int8
and int4 mode -- a request's greedy tokens must be identical alone, in a
batch of mixed-length prompts, and with prefix caching on or off, because
the quantized kernels compute each output row independently of the others
(checked here, not assumed). The KV pool must return to idle."""
import pytest

from kiln import SamplingParams
from tests.integration.llm.bench_text import mixed_prompts
from tests.integration.llm.test_batch_invariance import assert_idle

pytestmark = pytest.mark.slow
NUM_PROMPTS, NUM_TOKENS = 6, 12
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return mixed_prompts(smollm2_tokenizer, NUM_PROMPTS)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_batch_and_prefix_cache_do_not_change_greedy_tokens(make_smollm2_engine, prompts, method):
    alone_llm = make_smollm2_engine(quantization=method, enable_prefix_caching=False)
    alone = [alone_llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]
    assert_idle(alone_llm)
    del alone_llm
    for caching in (True, False):
        llm = make_smollm2_engine(quantization=method, enable_prefix_caching=caching)
        outs = llm.generate(prompts, PARAMS)
        for i, (out, ref) in enumerate(zip(outs, alone, strict=True)):
            assert out.outputs[0].token_ids == ref, f"{method} caching={caching}: prompt {i} ({len(prompts[i])} tokens)"
        assert_idle(llm)


def test_int8_activations_are_an_opt_in_that_keeps_answers_batch_independent(make_smollm2_engine, prompts):
    """`--int4-activations int8`: the kept Q4_1 projections and the Q8_0 head quantize their inputs
    (llama.cpp's numerics); the fused decode layer takes them too, and answers still do not depend on
    the batch."""
    from kiln.llm.quant.int4_cpu import Int4CpuLinear
    from kiln.llm.quant.q8_0_head import Q8_0Head

    llm = make_smollm2_engine(int4_activations="int8", enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    int4 = [m for m in model.modules() if isinstance(m, Int4CpuLinear)]
    assert int4 and all(m.int8_activations for m in int4)
    assert model.fused_layers and {f.group_size for f in model.fused_layers} == {-int4[0].group_size}
    assert isinstance(model.logits_head, Q8_0Head) and model.logits_head.int8_activations
    alone = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts[:3]]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], PARAMS)]
    assert together == alone
    assert_idle(llm)


def test_int8_activations_under_dtype_auto_run_in_float32(make_smollm2_engine):
    """`kiln serve --int4-activations int8` leaves `--dtype auto`: the engine builds on any CPU
    (float32: the option's kernels take fp32 activations) and answers as with an explicit float32."""
    llm = make_smollm2_engine(dtype="auto", int4_activations="int8", enable_prefix_caching=False)
    assert llm.engine.core.config.model.dtype == "float32"
    explicit = make_smollm2_engine(int4_activations="int8", enable_prefix_caching=False)
    prompt = ["The capital of France is"]
    answer = llm.generate(prompt, PARAMS)[0].outputs[0].token_ids
    assert answer == explicit.generate(prompt, PARAMS)[0].outputs[0].token_ids
