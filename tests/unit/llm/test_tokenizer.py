"""kiln Tokenizer over the SmolLM2 tokenizer (from GGUF and from a HF dir)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kiln.errors import InvalidRequestError, ModelLoadError
from kiln.llm.tokenizer import Tokenizer, load_tokenizer

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
EXPECTED_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_special_ids_and_vocab(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1  # <|im_start|>
    assert tok.eos_token_ids == (2,)  # <|im_end|>
    assert tok.hf.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_encode_decode_round_trip(smollm2_tokenizer):
    text = "Hello, world! 😀 日本語 — naïve café"
    ids = smollm2_tokenizer.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert smollm2_tokenizer.encode(text, add_special_tokens=True) == ids  # GGUF says add_bos_token=False
    assert smollm2_tokenizer.decode(ids) == text


def test_decode_skips_special_tokens(smollm2_tokenizer):
    ids = [1] + smollm2_tokenizer.encode("hi") + [2]
    assert smollm2_tokenizer.decode(ids) == "hi"
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_the_rust_decode_gives_what_transformers_decode_gives(smollm2_tokenizer):
    """Tokenizer.decode skips transformers' Python layers for a fast tokenizer
    whose class adds nothing to them; every piece the detokenizer decodes
    (prefixes that end inside a multi-byte character, special tokens either way,
    nothing) is what hf.decode gives without space clean-up."""
    tok = smollm2_tokenizer
    assert tok._rust_decode is not None
    ids = [1] + tok.encode("Hello , world ! 😀 日本語 — naïve  café .") + [2, 0]
    for end in range(len(ids) + 1):
        for start in (0, 1, end // 2):
            piece = ids[start:end]
            for skip in (True, False):
                expected = tok.hf.decode(piece, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                assert tok.decode(piece, skip_special_tokens=skip) == expected


def test_a_tokenizer_class_with_its_own_decode_keeps_transformers_decode(smollm2_tokenizer):
    from kiln.llm.tokenizer import rust_decoder

    class Shouting(type(smollm2_tokenizer.hf)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    hf = copy.copy(smollm2_tokenizer.hf)
    hf.__class__ = Shouting
    assert rust_decoder(hf) is None
    tok = Tokenizer(hf, "shouting")
    assert tok.decode(tok.encode("hi there")) == "HI THERE"


def test_chat_template_from_gguf_metadata(smollm2_tokenizer):
    assert smollm2_tokenizer.chat_template is not None
    assert "<|im_start|>" in smollm2_tokenizer.chat_template
    assert smollm2_tokenizer.render_chat(MESSAGES) == EXPECTED_PROMPT
    assert smollm2_tokenizer.render_chat(MESSAGES, add_generation_prompt=False) == EXPECTED_PROMPT.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_apply_chat_template_ids(smollm2_tokenizer):
    ids = smollm2_tokenizer.apply_chat_template(MESSAGES)
    assert ids == smollm2_tokenizer.encode(EXPECTED_PROMPT, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # im_start ... two im_end
    # Same ids as transformers' own tokenize=True path.
    hf_ids = smollm2_tokenizer.hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
    assert ids == list(hf_ids)


def test_no_chat_template_is_a_request_error(smollm2_tokenizer):
    tok = Tokenizer(smollm2_tokenizer.hf, "test")
    original = tok.hf.chat_template
    tok.hf.chat_template = None
    try:
        with pytest.raises(InvalidRequestError, match="no chat template"):
            tok.render_chat(MESSAGES)
    finally:
        tok.hf.chat_template = original


def test_template_rejection_is_a_request_error(smollm2_tokenizer):
    tok = Tokenizer(smollm2_tokenizer.hf, "test")
    original = tok.hf.chat_template
    tok.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(InvalidRequestError, match="roles must alternate"):
            tok.render_chat(MESSAGES)
    finally:
        tok.hf.chat_template = original


def test_hf_directory_matches_gguf(tiny_llama_dir, smollm2_tokenizer):
    tok = load_tokenizer(tiny_llama_dir)
    text = "The quick brown fox 🦊 jumps."
    assert tok.encode(text) == smollm2_tokenizer.encode(text)
    assert tok.eos_token_ids == smollm2_tokenizer.eos_token_ids
    assert tok.render_chat(MESSAGES) == EXPECTED_PROMPT


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        load_tokenizer(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)


def test_directory_without_tokenizer(tmp_path):
    # transformers' five-line message about sentencepiece before; now one line naming the files looked for.
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) == f"no tokenizer in {tmp_path}: none of tokenizer.json, tokenizer.model, vocab.json, " \
        "tiktoken.model"


def test_a_gguf_without_tokenizer_metadata_says_so(tmp_path):
    import gguf
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(path)
    assert str(e.value).startswith(f"cannot load tokenizer from {path}: ") and "\n" not in str(e.value)


def test_a_gguf_tokenizer_is_converted_once_and_read_from_the_cache(smollm2_path, tmp_path, monkeypatch):
    from kiln.llm import tokenizer as tokenizer_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tokenizer_module.tokenizer_cache_dir(Path(smollm2_path))
    assert cache is not None and cache.parent == tmp_path / "kiln" / "tokenizers" and not cache.exists()
    converted = tokenizer_module.gguf_tokenizer(Path(smollm2_path))
    assert (cache / "tokenizer.json").is_file()
    cached = tokenizer_module.gguf_tokenizer(Path(smollm2_path))  # read back from the cache
    text = "Hello <|im_start|>world ünï 123\n"
    assert cached.encode(text) == converted.encode(text) and len(cached) == len(converted)
    assert cached.chat_template == converted.chat_template and cached.eos_token_id == converted.eos_token_id
    monkeypatch.setenv("KILN_TOKENIZER_CACHE", "0")
    assert tokenizer_module.tokenizer_cache_dir(Path(smollm2_path)) is None


def test_the_fast_reader_stands_in_for_ggufs_only_inside_the_block():
    import gguf

    from kiln.llm.models.gguf_loader import _FastGGUFReader, fast_gguf_reader

    stock = gguf.GGUFReader
    with fast_gguf_reader():
        assert gguf.GGUFReader is _FastGGUFReader
    assert gguf.GGUFReader is stock


MULTI_BYTE = "日本語のテキスト🎉 and é, 🧑‍🚀"


def test_token_bytes_are_what_each_byte_level_token_stands_for(smollm2_tokenizer):
    # Reference: the tokenizer's own decode. Joined, the tokens' bytes are the text's
    # bytes (tokens here hold parts of characters); alone, each token's decode is
    # its bytes read lossily, over the whole vocabulary, special tokens included.
    tok = smollm2_tokenizer
    ids = tok.encode(MULTI_BYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == MULTI_BYTE.encode("utf-8")
    for i in range(tok.vocab_size):
        assert tok.token_bytes(i).decode("utf-8", "replace") == tok.decode([i], skip_special_tokens=False)


def test_token_bytes_of_a_sentencepiece_byte_fallback_tokenizer():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581": 257, "a": 258, "\u2581a": 259}
    rust = RustTokenizer(models.BPE(vocab, [("\u2581", "a")], unk_token="<unk>", byte_fallback=True))
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust), "sentencepiece-like")
    ids = tok.encode("a 日🎉", add_special_tokens=False)
    assert 259 in ids and 1 + 0xE6 in ids
    assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids).encode("utf-8") == " a 日🎉".encode()
