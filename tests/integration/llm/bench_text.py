"""Deterministic prompts of mixed lengths cut from text that ships with Python."""
from pydoc_data.topics import topics


def mixed_prompts(tokenizer, n: int, shared_prefix: int = 40) -> list[list[int]]:
    """`n` prompts of 8..~300 tokens. Every other prompt starts with the same
    `shared_prefix` tokens, so prefix caching has something to share."""
    text = "\n".join(topics[k] for k in sorted(topics)[:40])
    ids = tokenizer.encode(text, add_special_tokens=False)
    prefix = ids[:shared_prefix]
    prompts = []
    for i in range(n):
        length = 8 + (i * 37) % 150
        start = 1000 + i * 523
        body = ids[start : start + length]
        prompts.append(prefix + body if i % 2 == 0 else body)
    return prompts
