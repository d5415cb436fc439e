"""Schemas with keywords the grammar engine would drop are refused, naming
the keyword and where it is; the rest (keywords that only look alike) pass."""
from __future__ import annotations

import json

import pytest

from kiln.errors import InvalidRequestError
from kiln.llm.structured.spec import GrammarSpec
from kiln.llm.structured.validate import check_spec

ARRAY = {"type": "array", "items": {"type": "integer"}}


def spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json", json.dumps(schema))


@pytest.mark.parametrize(("schema", "named"), [
    ({**ARRAY, "uniqueItems": True}, "'uniqueItems' at (root)"),
    ({**ARRAY, "contains": {"const": 1}}, "'contains' at (root)"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at (root)"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if' at (root)"),
    ({"type": "object", "properties": {"x": {"not": {"type": "null"}}}}, "'not' at /properties/x"),
    ({"$defs": {"P": {**ARRAY, "uniqueItems": True}}, "$ref": "#/$defs/P"}, "'uniqueItems' at /$defs/P"),
    ({"type": "array", "items": {**ARRAY, "contains": {"const": 2}}}, "'contains' at /items"),
    ({"anyOf": [{"type": "string"}, {**ARRAY, "uniqueItems": True}]}, "'uniqueItems' at /anyOf/1"),
    ({"type": "string", "format": "email", "maxLength": 20}, "beside 'format' at (root)"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' with more than one schema at (root)"),
])
def test_a_keyword_the_engine_would_drop_is_refused_by_name(schema, named):
    with pytest.raises(InvalidRequestError, match="not enforced") as caught:
        check_spec(spec(schema), "response_format")
    assert named in str(caught.value) and caught.value.param == "response_format"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"not": {"type": "integer"}, "contains": {"type": "string"}}},  # names
    {**ARRAY, "uniqueItems": False},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
    {"type": "string", "maxLength": 20},
    {"type": "object", "properties": {"e": {"enum": [{"not": 1}]}}},  # data, not a schema
])
def test_keywords_it_enforces_or_mere_names_pass(schema):
    check_spec(spec(schema), "response_format")


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "object", "required": ["a"]}, "at (root) requires 'a'"),
    ({"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b", "a"],
      "additionalProperties": False}, "at (root) requires 'a'"),
    ({"type": "object", "patternProperties": {"^a": {}}, "required": ["a"]}, "at (root) requires 'a'"),
    ({"type": "array", "items": {"type": "object", "properties": {}, "required": ["x"]}}, "at /items requires 'x'"),
])
def test_a_required_name_its_properties_do_not_declare_is_refused(schema, named):
    # xgrammar leaves such a name out of the output ('{}' passes its grammar), so the
    # 200 would break the schema; declared (even as {}), it is enforced.
    with pytest.raises(InvalidRequestError, match="declare it in 'properties'") as caught:
        check_spec(spec(schema), "response_format")
    assert named in str(caught.value)
    check_spec(spec({"type": "object", "properties": {"a": {}}, "required": ["a"]}), "response_format")
