"""The batched sampler on CUDA: the per-request sampler's tokens (same
device generators), and host syncs that do not grow with the batch."""
import warnings

import torch

from kiln.llm.sampling.sampler import Sampler
from tests.unit.llm.sampling.per_request_sampler import PerRequestSampler
from tests.unit.llm.sampling.test_batched_sampler import VOCAB, requests_for


def syncs(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def test_same_tokens_as_the_per_request_sampler_on_cuda():
    for seed in range(4):
        batched, reference = Sampler("cuda", seed), PerRequestSampler("cuda", seed)
        mine, theirs = requests_for(seed, 32), requests_for(seed, 32)
        g = torch.Generator(device="cuda").manual_seed(seed)
        for _ in range(5):
            logits = torch.randn(32, VOCAB, device="cuda", generator=g) * 3
            got, want = batched(logits.clone(), mine), reference(logits.clone(), theirs)
            assert got == want
            for reqs, out in ((mine, got), (theirs, want)):
                for r, t in zip(reqs, out, strict=True):
                    r.output_token_ids.append(t.token_id)


def test_host_syncs_do_not_grow_with_the_batch():
    counts = {}
    for n in (8, 64):
        reqs = requests_for(7, n)
        logits = torch.randn(n, VOCAB, device="cuda")
        Sampler("cuda", 0)(logits.clone(), reqs)  # warm-up: pinned buffers, kernels
        _, counts[n] = syncs(lambda r=reqs, lg=logits: Sampler("cuda", 0)(lg.clone(), r))
        _, counts[("old", n)] = syncs(lambda r=reqs, lg=logits: PerRequestSampler("cuda", 0)(lg.clone(), r))
    assert counts[8] == counts[64] <= 3, counts  # the tokens (and logprobs) copied back
    assert counts[("old", 64)] > counts[("old", 8)] > counts[8], counts
