"""TP=2 on the real SmolLM2-135M (9 query heads, 3 KV heads: an uneven 6+3
split) against one process: identical greedy text for eight prompts in one
batch, prompt logits within LOGITS_ATOL (values ~1e1; 30 layers of
reordered float32 sums), each rank holding about half the weights. Both
keep a float32 KV pool: the GGUF's default float16 pool would round the
ranks' reordered sums to different float16 steps (measured 0.005)."""
from __future__ import annotations

import pytest
import torch

from kiln import SamplingParams
from kiln.llm.parallel.model import resident_weight_bytes
from tests.integration.llm.test_numerics import PROMPTS
from tests.integration.parallel.test_tiny_parallel import prompt_logits

pytestmark = pytest.mark.slow
LOGITS_ATOL = 2e-3
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_smollm2_tp2_matches_one_process(make_smollm2_engine, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts) >= 8
    fp32_pool = dict(num_blocks=128, kv_cache_dtype="float32")
    single = make_smollm2_engine(quantization="float", **fp32_pool)  # TP runs a GGUF as float
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, PARAMS)]
    ref_logits = prompt_logits(single, prompts[0])
    total = resident_weight_bytes(single.engine.core.runner.model)
    del single

    tp = make_smollm2_engine(tensor_parallel_size=2, **fp32_pool)
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, PARAMS)] == expected
        got = prompt_logits(tp, prompts[0])
        assert (got - ref_logits).abs().max().item() < LOGITS_ATOL
        per_rank = tp.engine.core.runner.resident_weight_bytes()
    finally:
        tp.shutdown()
    assert len(per_rank) == 2
    for nbytes in per_rank:
        assert 0.4 * total < nbytes < 0.6 * total, (per_rank, total)


def test_gguf_worker_reader_slices_match_the_full_load(smollm2_path, smollm2_checkpoint):
    """Workers dequantize one GGUF tensor at a time; slices equal the full load's."""
    from kiln.llm.parallel.weights import open_weights

    arch, reader, _ = open_weights(str(smollm2_path))
    assert arch == smollm2_checkpoint.arch
    names = (
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
    )
    weights = smollm2_checkpoint.dequantized_weights()
    for name in names:
        full = weights[name]
        assert torch.equal(reader.read(name, 0, 2, 7), full[2:7])
        assert torch.equal(reader.read(name, 1, 10, 20), full[:, 10:20])
