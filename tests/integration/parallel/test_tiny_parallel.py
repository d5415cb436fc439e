"""TP=2, PP=2 and TP=2 x PP=2 on tiny random Llamas against one process.

Greedy outputs of eight prompts in one continuous batch must be identical;
prompt logits within LOGITS_ATOL (float32; TP only reorders sums, values ~0.1);
every rank must hold about 1/N of the weights, measured from its own
parameter storage. (With tied embeddings and PP, the first and last stages
each hold their own copy of their vocabulary rows, as they must.)
"""
from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.errors import EngineDeadError
from kiln.llm.parallel.model import resident_weight_bytes
from kiln.llm.request import Request
from kiln.llm.scheduler.output import ScheduledChunk, SchedulerOutput

NUM_TOKENS = 16
LOGITS_ATOL = 1e-5
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    core = llm.engine.core
    req = Request("logits", ids, SamplingParams(max_tokens=1))
    core.kv.allocate(req, len(ids))
    try:
        return core.runner.logits_for(SchedulerOutput([ScheduledChunk(req, 0, len(ids), core.kv.block_ids("logits"))]))
    finally:
        core.kv.free(req)


def greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, tiny_kv1_dir, token_prompts):
    refs = {}
    for name, directory in (("tiny", tiny_llama_dir), ("kv1", tiny_kv1_dir)):
        llm = LLM(str(directory), num_blocks=64, dtype="float32")
        weight_bytes = resident_weight_bytes(llm.engine.core.runner.model)
        refs[name] = (greedy(llm, token_prompts), prompt_logits(llm, token_prompts[0]), weight_bytes)
    return refs


CASES = [
    ("tiny", dict(tensor_parallel_size=2)),
    ("tiny", dict(pipeline_parallel_size=2)),
    ("tiny", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    # One KV head replicated on both TP ranks, tied embeddings, 3 layers on 2 stages, 3 micro-batches.
    ("kv1", dict(tensor_parallel_size=2, pipeline_parallel_size=2, num_micro_batches=3)),
]


@pytest.mark.parametrize("model,options", CASES, ids=["tp2", "pp2", "tp2xpp2", "kv1-tp2xpp2-mb3"])
def test_parallel_matches_one_process(model, options, references, tiny_llama_dir, tiny_kv1_dir, token_prompts):
    ref_tokens, ref_logits, ref_bytes = references[model]
    directory = tiny_llama_dir if model == "tiny" else tiny_kv1_dir
    with LLM(str(directory), num_blocks=64, dtype="float32", **options) as llm:
        assert greedy(llm, token_prompts) == ref_tokens
        got = prompt_logits(llm, token_prompts[0])
        assert got.shape == ref_logits.shape
        assert (got - ref_logits).abs().max().item() < LOGITS_ATOL
        per_rank = llm.engine.core.runner.resident_weight_bytes()
        arch = llm.engine.arch
    world = len(per_rank)
    assert world == options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1)
    total = ref_bytes
    if arch.tie_word_embeddings and options.get("pipeline_parallel_size", 1) > 1:
        total += arch.vocab_size * arch.hidden_size * 4  # the last stage's own LM-head rows
    for rank, nbytes in enumerate(per_rank):
        assert 0.75 * total / world < nbytes < 1.25 * total / world, (rank, nbytes, total)


def test_tp2_with_a_float16_kv_cache_matches_one_process(tiny_llama_dir, token_prompts):
    one = greedy(LLM(str(tiny_llama_dir), num_blocks=64, dtype="float32", kv_cache_dtype="float16"), token_prompts)
    options = dict(num_blocks=64, dtype="float32", kv_cache_dtype="float16", tensor_parallel_size=2)
    with LLM(str(tiny_llama_dir), **options) as llm:
        assert all(pool.dtype == torch.float16 for pool in llm.engine.core.runner.stage.kv_caches)  # rank 0's shard
        assert greedy(llm, token_prompts) == one
    with pytest.raises(EngineDeadError, match="this LLM was shut down"):  # was "a collective failed"
        greedy(llm, token_prompts)
