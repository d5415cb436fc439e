"""Structured-output request fields become the grammar they ask for."""
from __future__ import annotations

import pytest

from kiln.frontends.openai.structured import choice_grammar
from kiln.llm.structured.validate import check_spec

CHOICES = ["🎉", "a🎉b", 'say "hi"', "back\\slash", "tab\tnew\nline", "\x01\x7f", "日本語", "é"]


def accepts(choices: list[str], text: str) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(choice_grammar(choices).value), text)


@pytest.mark.parametrize("choice", CHOICES)
def test_a_choice_is_matched_exactly_whatever_its_characters(choice):
    check_spec(choice_grammar(CHOICES), "guided_choice")
    assert accepts(CHOICES, choice)
    assert not accepts(CHOICES, choice + "x") and not accepts(CHOICES, choice[:-1])


def test_a_json_schema_name_follows_openais_rule():
    from kiln.errors import InvalidRequestError
    from kiln.frontends.openai.common import parse
    from kiln.frontends.openai.protocol import ChatCompletionRequest

    def request(name: str) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": name, "schema": {"type": "object"}}}}

    for good in ("weather_report-2", "a" * 64):
        assert parse(ChatCompletionRequest, request(good)).response_format.json_schema.name == good
    for bad in ("", "has space", "dot.name", "a" * 65, "émoji"):
        with pytest.raises(InvalidRequestError) as caught:
            parse(ChatCompletionRequest, request(bad))
        assert caught.value.param == "response_format.json_schema.name" and "name" in caught.value.message
