"""Request parsing: strict types, unknown fields rejected, errors name the field."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidRequestError, ModelLoadingError, OverloadedError, PromptTooLongError
from kiln.frontends.errors import error_response
from kiln.frontends.openai.common import parse
from kiln.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest


def parse_error(model, body) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        parse(model, body)
    return e.value


def test_valid_completion_request_with_vllm_extras():
    req = parse(
        CompletionRequest,
        {
            "prompt": [1, 2],
            "temperature": 0,
            "top_k": 5,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [7],
            "priority": 1,
            "stream_options": {"include_usage": True},
        },
    )
    assert req.prompt == [1, 2] and req.temperature == 0.0 and req.stream_options.include_usage


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"prompt": "x", "foo": 1}, "foo", "unknown field 'foo'"),
        ({"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "unknown field"),
        ({"prompt": "x", "temperature": "0.5"}, "temperature", "temperature"),
        ({"prompt": "x", "n": 1.5}, "n", "n"),
        ({"prompt": "x", "stream": "true"}, "stream", "stream"),
        ({}, "prompt", "missing required field 'prompt'"),
        ({"prompt": {"text": "x"}}, "prompt", "prompt"),
    ],
)
def test_bad_completion_fields_are_named(body, param, words):
    e = parse_error(CompletionRequest, body)
    assert e.param == param and words in e.message


def test_chat_message_content_parts_and_roles():
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
            ]
        },
    )
    assert [m.text() for m in req.messages] == ["Be brief.", "Hello"]
    e = parse_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "picture"}]}]})
    assert e.param.startswith("messages.0.content")
    # An image part parses, so that it can be refused naming the model (serving_chat.check_messages).
    from kiln.frontends.openai.serving_chat import check_messages

    image = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    with pytest.raises(InvalidRequestError, match="model 'tiny' does not support image_url") as refused:
        check_messages(image.messages, "tiny")
    assert refused.value.param == "messages.0.content.1"


def test_error_response_shape_and_retry_after():
    r = error_response(PromptTooLongError("too long", param="prompt"))
    assert r.status_code == 400 and b'"param":"prompt"' in r.body and "retry-after" not in r.headers
    r = error_response(OverloadedError("full"))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    r = error_response(ModelLoadingError("loading"))
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
