"""Workloads: (prompt, max_tokens) pairs from a JSONL file or made up, seeded.

    jsonl   one object per line: {"prompt": str, "max_tokens": int}
    random  random words, lengths drawn uniformly in [len*(1-r), len*(1+r)]
    text    consecutive words of real text that ships with Python
            (pydoc_data.topics), same length rule

Lengths of made-up prompts are in words, which tokenizers turn into a
somewhat larger number of tokens; the report counts real tokens from usage.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    max_tokens: int


def load_jsonl(path: str | Path, default_max_tokens: int) -> list[WorkItem]:
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{n}: each line needs a string 'prompt'")
        items.append(WorkItem(obj["prompt"], int(obj.get("max_tokens", default_max_tokens))))
    return items


def corpus_words() -> list[str]:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    return re.findall(r"\S+", text)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def synthetic(kind: str, num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[WorkItem]:
    rng = random.Random(seed)
    words = corpus_words()
    vocab = sorted(set(words)) if kind == "random" else None
    items = []
    for _ in range(num):
        n_in = _length(rng, input_len, range_ratio)
        if vocab is not None:
            prompt_words = rng.choices(vocab, k=n_in)
        else:
            start = rng.randrange(0, len(words) - n_in)
            prompt_words = words[start : start + n_in]
        items.append(WorkItem(" ".join(prompt_words), _length(rng, output_len, range_ratio)))
    return items
