"""Kiln's model and engine against Hugging Face transformers on the same weights.

Tolerances (float32 on CPU): logits within 1e-4 absolute for the tiny
random model (values ~1e-1), within 2e-3 for SmolLM2 (values ~1e1, 30
layers of accumulated rounding); greedy continuations must be identical.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln import LLM, SamplingParams
from kiln.llm.request import Request
from kiln.llm.scheduler.output import ScheduledChunk, SchedulerOutput

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "import numpy as np\n",
    "Water boils at",
    "List of planets: Mercury, Venus,",
    "Q: What is the square root of 144?\nA:",
]
GREEDY_TOKENS = 32


def kiln_prompt_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Logits for every prompt position from one flattened prefill step."""
    core = llm.engine.core
    req = Request("logits", token_ids, SamplingParams(max_tokens=1))
    core.kv.allocate(req, len(token_ids))
    try:
        chunk = ScheduledChunk(req, 0, len(token_ids), core.kv.block_ids("logits"))
        return core.runner.logits_for(SchedulerOutput([chunk]))
    finally:
        core.kv.free(req)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache. (generate() with
    min_new_tokens would mask EOS, which ignore_eos does not do.)"""
    out_ids = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(out.logits[0, -1].argmax())
            out_ids.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def check_against_hf(llm: LLM, hf, atol: float) -> None:
    tok = llm.tokenizer
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        got = kiln_prompt_logits(llm, ids)
        assert (got - ref).abs().max().item() < atol, prompt
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)  # all eight in one continuous batch
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_greedy(hf, tok.encode(prompt), GREEDY_TOKENS)
        assert out.outputs[0].token_ids == expected, prompt


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir"])
def test_tiny_llama_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = LLM(str(path), kv_cache_memory_gib=0.05)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    check_against_hf(llm, hf, atol=1e-4)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_llm, smollm2_hf_model):
    check_against_hf(smollm2_llm, smollm2_hf_model, atol=2e-3)
