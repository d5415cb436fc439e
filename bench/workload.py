"""The seeded offline workload shared by Kiln's throughput benchmarks.

Prompts are slices of real English text that ships with Python (the pydoc
topic pages), so tokenization behaves like real traffic; lengths are drawn
uniformly from the given ranges with a fixed seed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pydoc_data.topics import topics


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


def corpus_text() -> str:
    return "\n\n".join(topics[k] for k in sorted(topics))


def make_workload(
    tokenizer,
    num_requests: int = 64,
    prompt_len: tuple[int, int] = (64, 512),
    output_len: tuple[int, int] = (32, 256),
    seed: int = 0,
) -> list[WorkItem]:
    rng = random.Random(seed)
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    items = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        start = rng.randrange(0, len(ids) - n)
        items.append(WorkItem(ids[start : start + n], rng.randint(*output_len)))
    return items
