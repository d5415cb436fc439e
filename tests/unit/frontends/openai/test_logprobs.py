"""Chat logprobs: a token's `bytes` are its real bytes, even for part of a character."""
from __future__ import annotations

from kiln.frontends.openai.logprobs import TokenTexts, chat_logprobs
from kiln.llm.outputs import TokenLogprob

CONTENT = "こんにちは、世界!🎉🚀"


def test_the_tokens_bytes_join_into_the_contents_bytes(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(CONTENT, add_special_tokens=False)
    entries = [TokenLogprob(i, -0.5, top=[(i, -0.5), (ids[0], -2.0)]) for i in ids]
    body = chat_logprobs(entries, TokenTexts(tok))["content"]
    assert bytes(b for item in body for b in item["bytes"]) == CONTENT.encode("utf-8")
    # the reference per token: the tokenizer's decode of a single token is its bytes read lossily
    for i, item in zip(ids, body, strict=True):
        assert item["token"] == tok.decode([i], skip_special_tokens=False)
        assert bytes(item["bytes"]).decode("utf-8", "replace") == item["token"]
        assert [alt["bytes"] for alt in item["top_logprobs"]] == [item["bytes"], body[0]["bytes"]]
    assert any(bytes(item["bytes"]) != item["token"].encode("utf-8") for item in body)  # part-characters present
