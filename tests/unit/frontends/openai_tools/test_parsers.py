"""Tool-call parsers: whole answers, and streams fed in any pieces giving the same calls."""

from __future__ import annotations

import json

import pytest

from kiln.frontends.openai.tools.parsers import (
    Content,
    KilnJsonStream,
    NamedStream,
    Parsed,
    ParsedCall,
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
    assert parsed.content == "Let me look.\n"  # as it streams: the whitespace beside a call is kept
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


TOOLS = {"get_weather", "ping", "search"}
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
NO_ARGUMENTS = '<tool_call>\n{"name": "ping"}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
NOT_AN_OBJECT = '<tool_call>\n{"name": "ping", "arguments": "{}"}\n</tool_call>'
JUNK_AFTER = '<tool_call>\n{"name": "ping", "arguments": {}} and more\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("invalid", [BROKEN, NO_ARGUMENTS, UNKNOWN, NOT_AN_OBJECT, JUNK_AFTER])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_an_invalid_or_unknown_hermes_call_is_content_streamed_or_whole(invalid, piece):
    # vLLM answers text whose call does not parse as content; a stream must agree, so
    # a call is only sent once it is known valid.
    for text in (invalid, "Sure.\n" + invalid + "\nDone."):
        assert parse(make_stream("hermes", TOOLS), text) == Parsed(text, [])
        assert collate(streamed(make_stream("hermes", TOOLS), text, piece)) == Parsed(text, [])
    # beside a valid call, it is the content and the valid one the call
    text = invalid + "\n" + PING
    expected = Parsed(invalid + "\n", [ParsedCall("ping", "{}")])
    assert parse(make_stream("hermes", TOOLS), text) == expected
    assert collate(streamed(make_stream("hermes", TOOLS), text, piece)) == expected


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_an_end_tag_inside_an_argument_string_and_an_unclosed_last_call(piece):
    text = ('<tool_call>\n{"name": "search", "arguments": {"q": "</tool_call>"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "ping", "arguments": {"n": 1}}')  # cut by max_tokens after a whole object
    expected = Parsed(None, [ParsedCall("search", '{"q": "</tool_call>"}'), ParsedCall("ping", '{"n": 1}')])
    assert parse(make_stream("hermes", TOOLS), text) == expected
    assert collate(streamed(make_stream("hermes", TOOLS), text, piece)) == expected


def test_whitespace_beside_a_call_streams_and_reads_whole_the_same():
    text = "Sure.\n" + PING + "\n"
    for piece in (1, 3, 1000):
        assert collate(streamed(make_stream("hermes", TOOLS), text, piece)).content == "Sure.\n"
    assert parse(make_stream("hermes", TOOLS), text) == Parsed("Sure.\n", [ParsedCall("ping", "{}")])
