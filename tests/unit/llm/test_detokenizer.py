"""IncrementalDetokenizer: streamed text equals the whole decode."""
from __future__ import annotations

import random

import pytest

from kiln.llm.detokenizer import IncrementalDetokenizer

MIXED = "Hello 😀👍🏽 日本語のテキスト 한국어 Ünïcödé ∑∫ 🇫🇷 end"


def _stream(tok, ids, chunk_sizes, skip_special_tokens=True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    for n in chunk_sizes:
        if i >= len(ids):
            break
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_equal_whole_decode(smollm2_tokenizer, skip_special_tokens):
    tok, rng = smollm2_tokenizer, random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        chunks = [rng.randrange(1, 4) for _ in ids]
        deltas, detok = _stream(tok, ids, chunks, skip_special_tokens)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text == expected, ids


def test_random_byte_tokens_equal_whole_decode(smollm2_tokenizer):
    # Single-byte tokens make broken and interleaved UTF-8 sequences likely.
    tok, rng = smollm2_tokenizer, random.Random(1)
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.hf.convert_ids_to_tokens(i)) == 1][:256]
    for _ in range(200):
        ids = [rng.choice(byte_ids) for _ in range(rng.randrange(1, 30))]
        deltas, detok = _stream(tok, ids, [1] * len(ids))
        assert "".join(deltas) == detok.text == tok.decode(ids)


@pytest.mark.parametrize("text", [MIXED, "🦊" * 5, "中文字符测试，标点。", "plain ascii text"])
def test_emoji_and_cjk_one_token_at_a_time(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    deltas, detok = _stream(smollm2_tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == detok.text == text
    assert all("\ufffd" not in d for d in deltas)  # never a half character


def test_partial_character_is_held_back(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(" 😀")
    assert len(ids) > 1  # the emoji's 4 UTF-8 bytes span several tokens
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.text == ""
    assert detok.add(ids[-1:]) == " 😀"
    assert detok.text == " 😀"


def test_finish_flushes_incomplete_character(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("a😀")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    streamed = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.finish() == smollm2_tokenizer.decode(ids)
    assert detok.text.endswith("\ufffd")


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("hi") + [2]
    skipped, _ = _stream(smollm2_tokenizer, ids, [1] * len(ids))
    kept, _ = _stream(smollm2_tokenizer, ids, [1] * len(ids), skip_special_tokens=False)
    assert "".join(skipped) == "hi"
    assert "".join(kept) == "hi<|im_end|>"
