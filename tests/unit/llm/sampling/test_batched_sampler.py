"""The batched sampler against the per-request sampler it replaced
(per_request_sampler.py): the same tokens and logprobs, step after step,
for mixed batches of greedy, temperature, top-k/top-p/min-p, penalties,
logit bias, min_tokens, seeded and unseeded requests, with logprobs.

One documented difference, not exercised here: with top_k = 0, top_p = 1
and min_p = 0 in every row the batched sampler skips the vocabulary sort,
while the old one could still drop tail tokens whose preceding mass summed
to 1.0 in float32 (probability ~1e-7 each)."""
import random

import pytest
import torch

from kiln.llm.request import Request
from kiln.llm.sampling.sampler import Sampler
from kiln.llm.sampling_params import SamplingParams
from tests.unit.llm.sampling.per_request_sampler import PerRequestSampler

VOCAB = 64


def random_params(rng: random.Random, i: int) -> SamplingParams:
    kind = rng.choice(["greedy", "plain", "top_k", "top_p", "min_p", "all"])
    kw = {"temperature": 0.0 if kind == "greedy" else rng.choice([0.5, 1.0, 1.3])}
    if kind in ("top_k", "all"):
        kw["top_k"] = rng.choice([1, 5, 20])
    if kind in ("top_p", "all"):
        kw["top_p"] = rng.choice([0.3, 0.9])
    if kind in ("min_p", "all"):
        kw["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.4:
        kw["seed"] = 1000 + i
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([0.8, 1.3])
        kw["presence_penalty"] = rng.choice([-0.5, 0.5])
        kw["frequency_penalty"] = rng.choice([0.0, 0.7])
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(VOCAB + 5): rng.uniform(-5, 5) for _ in range(3)}  # some out of range
    if rng.random() < 0.3:
        kw["min_tokens"] = 3
        kw["max_tokens"] = 10
        kw["stop_token_ids"] = [rng.randrange(VOCAB)]
        kw["ignore_eos"] = rng.random() < 0.5
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 5])
    return SamplingParams(**kw)


def requests_for(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))], random_params(rng, i),
                    eos_token_ids=(0,)) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_same_tokens_and_logprobs_as_the_per_request_sampler(seed):
    batched, reference = Sampler(seed=seed), PerRequestSampler(seed=seed)
    mine, theirs = requests_for(seed, 24), requests_for(seed, 24)
    g = torch.Generator().manual_seed(seed)
    for _ in range(6):
        logits = torch.randn(len(mine), VOCAB, generator=g) * 3
        got = batched(logits.clone(), mine)
        want = reference(logits.clone(), theirs)
        assert got == want
        for reqs, out in ((mine, got), (theirs, want)):
            for r, t in zip(reqs, out, strict=True):
                r.output_token_ids.append(t.token_id)
    assert any(t.top_logprobs for t in got)  # the mix did include logprobs


def test_a_batch_of_only_sampled_rows_and_one_of_only_greedy_rows():
    for params in (SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=0.0, logprobs=2)):
        reqs = [Request(f"r{i}", [1, 2], params) for i in range(5)]
        logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
        assert Sampler(seed=3)(logits.clone(), reqs) == PerRequestSampler(seed=3)(logits.clone(), reqs)
