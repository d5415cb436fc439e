"""Embeddings and prompt logprobs against transformers on the same weights,
with prompts split over several prefill chunks."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams

PROMPTS = [list(range(5, 45)), list(range(100, 107)), [3, 9, 27, 81, 243, 729, 2187]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # a 16-token budget splits the 40-token prompt over three chunks
    return LLM(str(tiny_llama_dir), num_blocks=64, max_num_batched_tokens=16, dtype="float32")  # exact vs HF


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@torch.no_grad()
def hf_outputs(hf, ids: list[int]):
    out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0], out.logits[0].log_softmax(dim=-1)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers(llm, hf, pooling):
    vectors = llm.embed(PROMPTS, pooling)
    for ids, vector in zip(PROMPTS, vectors, strict=True):
        hidden, _ = hf_outputs(hf, ids)
        ref = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        torch.testing.assert_close(torch.tensor(vector), ref, atol=2e-5, rtol=1e-4)
    assert not llm.engine.has_unfinished()
    assert llm.engine.core.kv.num_free_blocks == 64  # prefill-only: every block back at once


def test_prompt_logprobs_and_scoring_only_match_transformers(llm, hf):
    ids = PROMPTS[0]
    scored = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    _, logprobs = hf_outputs(hf, ids)
    entries = scored.prompt_logprobs
    assert entries[0] is None and len(entries) == len(ids)
    # scoring only reaches its max_tokens (0) at once: "length", as vLLM answers echo with max_tokens 0
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"
    for pos in range(1, len(ids)):
        row = logprobs[pos - 1]
        e = entries[pos]
        assert e.token_id == ids[pos]
        assert e.logprob == pytest.approx(float(row[ids[pos]]), abs=1e-4)
        assert e.rank == int((row > row[ids[pos]]).sum()) + 1
        top = row.topk(3)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_of_generated_tokens_match_transformers(llm, hf):
    ids = PROMPTS[1]
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=0))[0]
    completion = out.outputs[0]
    assert len(out.prompt_logprobs) == len(ids)
    _, logprobs = hf_outputs(hf, ids + completion.token_ids)
    for i, (token, e) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = logprobs[len(ids) - 1 + i]
        assert token == int(row.argmax()) and e.token_id == token
        assert e.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert [t for t, _ in e.top] == row.topk(2).indices.tolist()
