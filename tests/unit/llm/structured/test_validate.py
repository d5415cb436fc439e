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


def xgrammar_accepts(schema: dict, text: str) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(json.dumps(schema), strict_mode=True), text)


# Each schema, the keyword the message names, and an output xgrammar's grammar lets
# through although the schema forbids it (so accepting the schema would give a 200
# breaking it: the reason for the refusal, checked against `jsonschema`).
DROPPED_SIBLINGS = [
    ({"type": "integer", "enum": [1, "a", 2.5]}, "'type' beside 'enum' at (root)", '"a"'),
    ({"type": "string", "const": "abcdef", "maxLength": 2}, "'maxLength' beside 'const' at (root)", '"abcdef"'),
    ({"type": "integer", "const": "a"}, "'type' beside 'const' at (root)", '"a"'),
    ({"$ref": "#/$defs/a", "minimum": 0, "maximum": 3, "$defs": {"a": {"type": "integer"}}},
     "'maximum' beside '$ref' at (root)", "99"),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}], "maxLength": 2, "maximum": 5},
     "'maxLength' beside 'anyOf' at (root)", '"abcdef"'),
    ({"type": "integer", "anyOf": [{"minimum": 0, "maximum": 3}, {"minimum": 100, "maximum": 103}]},
     "'type' beside 'anyOf' at (root)", "{}"),
    ({"type": "integer", "oneOf": [{"minimum": 0}]}, "'type' beside 'oneOf' at (root)", '"x"'),
    ({"allOf": [{"type": "string"}], "maxLength": 2}, "'maxLength' beside 'allOf' at (root)", '"abcdef"'),
    ({"type": "string", "format": "date", "pattern": "^1999"}, "'pattern' beside 'format' at (root)",
     '"2000-01-01"'),
    ({"type": "object", "properties": {"a/b": {"type": "string", "enum": ["x", 1]}}},
     "'type' beside 'enum' at /properties/a~1b", '{"a/b": 1}'),
]


@pytest.mark.parametrize(("schema", "named", "invalid"), DROPPED_SIBLINGS)
def test_a_constraint_beside_a_keyword_the_engine_builds_alone_is_refused(schema, named, invalid):
    import jsonschema

    assert xgrammar_accepts(schema, invalid) and not jsonschema.Draft202012Validator(schema).is_valid(
        json.loads(invalid))
    with pytest.raises(InvalidRequestError, match="not enforced") as caught:
        check_spec(spec(schema), "response_format")
    assert named in str(caught.value) and caught.value.param == "response_format"


@pytest.mark.parametrize("schema", [
    {"enum": ["red", "green"], "type": "string", "title": "Color"},  # pydantic's Enum
    {"const": "cat", "type": "string"},  # pydantic's Literal
    {"type": "integer", "enum": [1, 2], "minimum": 0},
    {"type": "string", "format": "date", "enum": ["2024-01-31"]},
    {"$ref": "#/$defs/a", "description": "annotations only", "default": 1, "$defs": {"a": {"type": "integer"}}},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Optional"},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]}],
     "discriminator": {"propertyName": "k"}},  # an unknown keyword constrains nothing
])
def test_a_sibling_every_listed_value_satisfies_or_an_annotation_passes(schema):
    check_spec(spec(schema), "response_format")


def test_a_ref_beside_an_enum_is_checked_in_the_whole_document():
    defs = {"$defs": {"small": {"type": "integer", "maximum": 5}}}
    check_spec(spec({"type": "object", "properties": {"n": {"enum": [3], "allOf": [{"$ref": "#/$defs/small"}]}},
                     **defs}), "response_format")
    with pytest.raises(InvalidRequestError, match="'allOf' beside 'enum' at /properties/n"):
        check_spec(spec({"type": "object", "properties": {"n": {"enum": [3, 9], "allOf": [{"$ref": "#/$defs/small"}]}},
                         **defs}), "response_format")


def test_the_keyword_order_is_xgrammars_precedence():
    # Each keyword admits only its own marker; the grammar of any two together admits
    # the marker of the one earlier in SCHEMA_REPLACING, which the check treats as kept.
    from kiln.llm.structured.validate import SCHEMA_REPLACING

    alone = {"$ref": {"$ref": "#/$defs/r"}, "const": {"const": 2}, "enum": {"enum": [3]},
             "anyOf": {"anyOf": [{"const": 4}]}, "oneOf": {"oneOf": [{"const": 5}]}, "allOf": {"allOf": [{"const": 6}]}}
    marker = {"$ref": "1", "const": "2", "enum": "3", "anyOf": "4", "oneOf": "5", "allOf": "6"}
    for i, first in enumerate(SCHEMA_REPLACING):
        for later in SCHEMA_REPLACING[i + 1:]:
            both = {**alone[later], **alone[first], "$defs": {"r": {"const": 1}}}
            assert xgrammar_accepts(both, marker[first]) and not xgrammar_accepts(both, marker[later])
