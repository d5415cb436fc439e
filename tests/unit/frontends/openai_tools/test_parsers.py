"""Tool-call parsers: whole answers, and streams fed in any pieces giving the same calls."""

from __future__ import annotations

import json

import pytest

from kiln.frontends.openai.tools.parsers import (
    Content,
    KilnJsonStream,
    NamedStream,
    ToolArgs,
    ToolStart,
    collate,
    make_stream,
    parse,
)

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
    '\n<tool_call>\n{"arguments": {"q": "a } in a string \\" and an escape"}, "name": "search"}\n</tool_call>'
)
LLAMA3 = '<|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": "]"}]}}; {"name": "g", "parameters": {}}'
REQUIRED = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": "c"}}]'


def streamed(stream, text: str, piece: int):
    events = []
    for i in range(0, len(text), piece):
        events += stream.feed(text[i : i + piece])
    return events + stream.finish()


def test_hermes_calls_and_content():
    parsed = parse(make_stream("hermes"), HERMES)
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("search", {"q": 'a } in a string " and an escape'}),
    ]
    # the arguments are the model's own text, byte for byte
    assert parsed.calls[0].arguments == '{"city": "Paris", "days": [1, 2]}'


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("factory", "text"), [
    (lambda: make_stream("hermes"), HERMES),
    (lambda: make_stream("llama3_json"), LLAMA3),
    (KilnJsonStream, REQUIRED),
])
def test_streaming_in_any_pieces_gives_the_whole_answer(factory, text, piece):
    whole = parse(factory(), text)
    events = streamed(factory(), text, piece)
    assert collate(events) == whole
    # a call's name comes before any of its argument text
    seen: set[int] = set()
    for e in events:
        if isinstance(e, ToolStart):
            seen.add(e.index)
        elif isinstance(e, ToolArgs):
            assert e.index in seen


def test_llama3_json_calls_and_plain_text():
    parsed = parse(make_stream("llama3_json"), LLAMA3)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"a": [1, {"b": "]"}]}'), ("g", "{}")]
    assert parse(make_stream("llama3_json"), "Hello there").content == "Hello there"


def test_text_that_only_looks_like_a_tag_is_content():
    parsed = parse(make_stream("hermes"), "a <tool and <tool_cal")
    assert parsed.content == "a <tool and <tool_cal" and parsed.calls == []


def test_kiln_required_format_and_named_function():
    parsed = parse(KilnJsonStream(), REQUIRED)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"a": 1}'), ("g", '{"b": "c"}')]
    events = streamed(NamedStream("f"), '{"x": 1}', 3)
    assert events[0] == ToolStart(0, "f")
    assert "".join(e.text for e in events if isinstance(e, ToolArgs)) == '{"x": 1}'
    assert not any(isinstance(e, Content) for e in events)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown tool parser"):
        make_stream("mistral")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_an_answer_without_calls_is_the_text_it_streams(parser):
    # Whole, the content was stripped; streamed, it was not: "...}" vs "...}\n".
    text = "  The answer is *}\n"
    streamed_text = "".join(e.text for e in streamed(make_stream(parser), text, 3) if isinstance(e, Content))
    assert parse(make_stream(parser), text).content == text == streamed_text


def test_a_developer_message_reaches_the_template_as_system():
    # Templates know `system`: Qwen's dropped a `developer` turn for its default system
    # prompt, Gemma's refused it ("roles must alternate").
    from kiln.frontends.openai.protocol import ChatMessage
    from kiln.frontends.openai.tools.prompt import message_dict

    for knows_tools in (True, False):
        assert message_dict(ChatMessage(role="developer", content="Answer in French"), knows_tools) == {
            "role": "system", "content": "Answer in French"}
