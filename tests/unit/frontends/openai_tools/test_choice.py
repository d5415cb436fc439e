"""tool_choice and structured-output fields: plans, grammars, and 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.errors import InvalidRequestError
from kiln.frontends.openai.common import parse
from kiln.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest
from kiln.frontends.openai.structured import grammar_spec
from kiln.frontends.openai.tools.choice import check_against_structured, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


def error(fn) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        fn()
    return e.value


def test_auto_none_named_and_required_plans():
    assert plan_tools(chat(), "hermes").reader is None
    auto = plan_tools(chat(tools=[WEATHER, TIME]), "hermes")
    assert auto.spec is None and len(auto.tools) == 2 and auto.reader is not None
    none = plan_tools(chat(tools=[WEATHER], tool_choice="none"), "hermes")
    assert none.tools == [] and none.reader is None
    named = plan_tools(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}), "hermes")
    assert json.loads(named.spec.value) == WEATHER["function"]["parameters"]
    required = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), "hermes")
    schema = json.loads(required.spec.value)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {}}] * 2, [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_tool_errors_name_the_field():
    assert error(lambda: plan_tools(chat(tool_choice="auto"), "hermes")).param == "tool_choice"
    unknown = error(lambda: plan_tools(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "launch"}}), "hermes"))
    assert unknown.param == "tool_choice" and "launch" in unknown.message
    assert error(lambda: plan_tools(chat(tools=[WEATHER, WEATHER]), "hermes")).param == "tools"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
    assert error(lambda: plan_tools(chat(tools=[bad_schema]), "hermes")).param == "tools[0].function.parameters"
    assert error(lambda: parse(ChatCompletionRequest, {"messages": [], "tools": [{"type": "function"}]})).param
    forced = plan_tools(chat(tools=[WEATHER], tool_choice="required"), "hermes")
    assert error(lambda: check_against_structured(forced, "response_format")).param == "response_format"


def test_structured_fields_become_one_checked_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    field, spec = grammar_spec(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}))
    assert field == "response_format" and spec.kind == "json" and json.loads(spec.value) == schema
    assert grammar_spec(chat(response_format={"type": "json_object"}))[1].kind == "json_object"
    assert grammar_spec(chat(response_format={"type": "text"})) is None
    assert grammar_spec(chat(structured_outputs={"regex": "[0-9]+"}))[1].kind == "regex"
    assert grammar_spec(chat(structured_outputs={"grammar": 'root ::= "a" | "b"'}))[1].kind == "ebnf"
    assert grammar_spec(chat(guided_grammar='start: "a" | "b"'))[1].kind == "lark"
    assert grammar_spec(chat(guided_choice=["yes", 'no "way"']))[1].value == 'root ::= "yes" | "no \\"way\\""'
    assert grammar_spec(parse(CompletionRequest, {"prompt": "x", "guided_json": schema}))[1].kind == "json"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {
        "$ref": "#/$defs/missing"}}}}}}, "response_format", "missing"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "Unclosed"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex", "at most one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex",
     "at most one"),
])
def test_structured_field_errors_name_the_field(fields, param, words):
    e = error(lambda: grammar_spec(chat(**fields)))
    assert e.param == param and words in e.message


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_a_function_without_parameters_takes_only_empty_arguments(tool_choice):
    # OpenAI: omitted parameters mean an empty parameter list, so {} is the only valid call.
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    plan = plan_tools(chat(tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice=tool_choice),
                      "hermes")
    grammar = xgrammar.Grammar.from_json_schema(plan.spec.value, strict_mode=True)

    def call(arguments: str) -> str:
        return f'[{{"name": "ping", "parameters": {arguments}}}]' if tool_choice == "required" else arguments

    assert _is_grammar_accept_string(grammar, call("{}"))
    assert not _is_grammar_accept_string(grammar, call('{"x": 1}'))
