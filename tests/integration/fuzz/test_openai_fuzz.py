"""Property-based fuzzing of the OpenAI request models against a live server
(issue 17): random JSON within and beyond every field's range gets 200 or a
4xx, never a 5xx or a hang, and a normal request succeeds right after."""

from __future__ import annotations

from hypothesis import given

from tests.integration.fuzz.checks import FUZZ, encode, post_expecting_an_answer, still_serving
from tests.integration.fuzz.strategies import CHAT, COMPLETION, DETOKENIZE, EMBEDDING, TOKENIZE


@FUZZ
@given(body=COMPLETION)
def test_completions(fuzz_server, body):
    post_expecting_an_answer(fuzz_server, "/v1/completions", encode(body))
    still_serving(fuzz_server)


@FUZZ
@given(body=CHAT)
def test_chat_completions(fuzz_server, body):
    post_expecting_an_answer(fuzz_server, "/v1/chat/completions", encode(body))
    still_serving(fuzz_server)


@FUZZ
@given(body=EMBEDDING)
def test_embeddings(fuzz_server, body):
    post_expecting_an_answer(fuzz_server, "/v1/embeddings", encode(body))
    still_serving(fuzz_server)


@FUZZ
@given(tokenize=TOKENIZE, detokenize=DETOKENIZE)
def test_tokenize_and_detokenize(fuzz_server, tokenize, detokenize):
    post_expecting_an_answer(fuzz_server, "/tokenize", encode(tokenize))
    post_expecting_an_answer(fuzz_server, "/detokenize", encode(detokenize))
    still_serving(fuzz_server)
