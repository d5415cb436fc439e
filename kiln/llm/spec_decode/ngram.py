"""Prompt-lookup proposer: continue the sequence the way it went the last
time its current suffix appeared (no model, no tensors on the device)."""
from __future__ import annotations

import numpy as np

from kiln.llm.request import Request
from kiln.llm.spec_decode.proposer import Proposer


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Find the longest n in [min_n, max_n] whose last n tokens occurred
    earlier; return up to k tokens that followed the most recent earlier
    occurrence (fewer if the sequence ends first). [] if none matches."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length-n-1: every earlier occurrence.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        pairs = zip(requests, num_drafts, strict=True)
        return [propose_ngram(r.all_token_ids, k, self.min_n, self.max_n) for r, k in pairs]
