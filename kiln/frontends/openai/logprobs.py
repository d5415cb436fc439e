"""Token logprobs in the two OpenAI shapes (completions and chat)."""

from __future__ import annotations

from kiln.llm.outputs import TokenLogprob
from kiln.llm.tokenizer import Tokenizer


class TokenTexts:
    """The text of single tokens (special tokens included), cached."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 65536):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.cache_size = cache_size

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self.cache) < self.cache_size:
                self.cache[token_id] = text
        return text


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offsets start at `offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        text = texts(e.token_id)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        alternatives = {texts(tid): lp for tid, lp in e.top}
        alternatives.setdefault(text, e.logprob)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}"""

    def item(token_id: int, logprob: float) -> dict:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(tid, lp) for tid, lp in e.top]} for e in entries
        ]
    }
