"""Token logprobs in the two OpenAI shapes (completions and chat)."""

from __future__ import annotations

from kiln.llm.outputs import TokenLogprob
from kiln.llm.tokenizer import Tokenizer

# JSON has no -inf: a token a grammar or a bias forbids (logprob -inf) is
# reported at this floor, as vLLM reports it.
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenTexts:
    """The text of single tokens (special tokens included), and their exact bytes, cached.

    The text of a token holding part of a UTF-8 character is lossy (U+FFFD, as
    vLLM's); its bytes are the real ones, so a choice's tokens' bytes join into
    its content's bytes."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 65536):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.byte_cache: dict[int, bytes] = {}
        self.cache_size = cache_size

    def token_bytes(self, token_id: int) -> bytes:
        raw = self.byte_cache.get(token_id)
        if raw is None:
            raw = self.tokenizer.token_bytes(token_id)
            if len(self.byte_cache) < self.cache_size:
                self.byte_cache[token_id] = raw
        return raw

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
        token_logprobs.append(json_logprob(e.logprob))
        alternatives = {texts(tid): json_logprob(lp) for tid, lp in e.top}
        alternatives.setdefault(text, json_logprob(e.logprob))
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}"""

    def item(token_id: int, logprob: float) -> dict:
        return {"token": texts(token_id), "logprob": json_logprob(logprob), "bytes": list(texts.token_bytes(token_id))}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(tid, lp) for tid, lp in e.top]} for e in entries
        ]
    }


def prompt_logprobs_body(entries: list[TokenLogprob | None], texts: TokenTexts) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt position (None for the first), token id ->
    {logprob, rank, decoded_token} for the prompt token and the top alternatives."""
    body: list[dict | None] = []
    for e in entries:
        if e is None:
            body.append(None)
            continue
        def entry(token_id: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": texts(token_id)}

        position = {str(tid): entry(tid, lp, i + 1) for i, (tid, lp) in enumerate(e.top)}
        position[str(e.token_id)] = entry(e.token_id, e.logprob, e.rank)
        body.append(position)
    return body


def echo_logprobs(entries: list[TokenLogprob | None], prompt_ids: list[int], texts: TokenTexts) -> dict:
    """Completions logprobs of an echoed prompt: its first token has none (null)."""
    body = completion_logprobs([e for e in entries if e is not None], texts)
    first = texts(prompt_ids[0])
    return {
        "tokens": [first, *body["tokens"]],
        "token_logprobs": [None, *body["token_logprobs"]],
        "top_logprobs": [None, *body["top_logprobs"]],
        "text_offset": [0, *(o + len(first) for o in body["text_offset"])],
    }


def joined_logprobs(head: dict, tail: dict) -> dict:
    """Two completions logprobs bodies, the second's text offsets moved after the first's text."""
    shift = sum(len(t) for t in head["tokens"])
    return {
        "tokens": head["tokens"] + tail["tokens"],
        "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
        "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
        "text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]],
    }
