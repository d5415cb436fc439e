"""API-side checks of a GrammarSpec: every problem is a 400 that names it.

JSON schemas are first checked against the JSON Schema meta-schema
(`jsonschema`), then converted by xgrammar (which names what it does not
support) and walked for keywords xgrammar accepts but does not enforce (a
schema with one would get a 200 whose output breaks it: refused instead);
regexes and grammars are parsed by xgrammar. No tokenizer is
needed, so this is cheap (the engine compiles against its vocabulary).
"""
from __future__ import annotations

import json
import re
from typing import Any

from kiln.errors import InvalidRequestError
from kiln.llm.structured.spec import GRAMMAR_KINDS, GrammarSpec

_LOCATION = re.compile(r"^(\[[^\]]*\]\s*)?\S+\.(cc|h|py):\d+:\s*")


def check_spec(spec: GrammarSpec, param: str) -> None:
    if spec.kind not in GRAMMAR_KINDS:
        raise InvalidRequestError(f"{param}: unknown grammar kind {spec.kind!r}", param=param)
    if spec.kind == "json":
        schema = parse_schema_text(spec.value, param)
        check_json_schema(schema, param)
        check_enforceable(schema, param)
    import xgrammar

    try:
        if spec.kind == "json":
            xgrammar.Grammar.from_json_schema(spec.value, strict_mode=True)
        elif spec.kind == "regex":
            xgrammar.Grammar.from_regex(spec.value)
        elif spec.kind == "ebnf":
            xgrammar.Grammar.from_ebnf(spec.value)
        elif spec.kind == "lark":
            xgrammar.Grammar.from_lark(spec.value)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"{param}: {_problem(e)}", param=param) from None


def parse_schema_text(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{param}: not valid JSON: {e}", param=param) from None


def check_json_schema(schema: Any, param: str) -> None:
    """The schema must be a JSON object (or boolean) valid under its meta-schema."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object", param=param)
    import jsonschema
    from jsonschema.exceptions import SchemaError

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise InvalidRequestError(f"{param}: invalid JSON schema at {where}: {e.message}", param=param) from None


# Keywords xgrammar compiles without enforcing (measured one keyword at a time:
# bench/grammar_engines.py, docs/benchmarks.md "Grammar engine"). `oneOf` is
# enforced as `anyOf` (only overlapping branches differ; documented, not refused:
# pydantic's unions use it) and an unanchored `pattern` as a full match (stricter:
# no invalid output), so neither is listed.
UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
              "dependencies", "if", "then", "else", "not")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedItems",
                  "unevaluatedProperties")


def check_enforceable(schema: Any, param: str, where: str = "", root: Any = None) -> None:
    """Refuse a keyword the grammar engine would silently drop, naming it and where it is.

    `root` is the whole document (the schema itself at the top): `$ref`s beside an
    `enum`/`const` resolve against it."""
    if not isinstance(schema, dict):
        return
    root = schema if root is None else root
    here = where or "(root)"
    for key in UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            raise InvalidRequestError(
                f"{param}: the JSON schema keyword {key!r} at {here} is not enforced by Kiln's grammar engine "
                "(xgrammar); remove it and check it after generation", param=param)
    for key in ("minLength", "maxLength", "pattern"):
        if "format" in schema and key in schema:  # xgrammar's string for a format replaces them
            raise InvalidRequestError(
                f"{param}: the JSON schema keyword {key!r} beside 'format' at {here} is not enforced by Kiln's "
                "grammar engine (xgrammar); use one or the other", param=param)
    check_no_dropped_siblings(schema, param, here, root)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise InvalidRequestError(
            f"{param}: 'allOf' with more than one schema at {here} is not enforced by Kiln's grammar engine "
            "(xgrammar); merge the schemas into one", param=param)
    check_required_declared(schema, param, here)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_enforceable(sub, param, f"{where}/{key}/{_pointer_token(name)}", root)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_enforceable(sub, param, f"{where}/{key}/{i}", root)
    for key in _SCHEMA_VALUES:
        value = schema.get(key)
        for i, sub in enumerate(value if isinstance(value, list) else [value]):  # items: a list in old drafts
            check_enforceable(sub, param, f"{where}/{key}" + (f"/{i}" if isinstance(value, list) else ""), root)


# xgrammar builds a schema holding one of these from that keyword alone (the first
# present in this order, its precedence, measured pair by pair) and drops every other
# constraint beside it, the others of these included: measured,
# e.g. {"type": "integer", "enum": [1, "a"]} lets "a" out, {"$ref": ..., "maximum": 3}
# lets 9 out, {"type": "integer", "anyOf": [...]} lets an object out.
SCHEMA_REPLACING = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# The JSON Schema keywords that constrain an instance (2020-12 and the older
# `dependencies`/`additionalItems`). Annotations (title, description, default,
# $defs, ...) and unknown keywords (OpenAPI's `discriminator`) constrain nothing,
# so they may stand beside a SCHEMA_REPLACING keyword.
CONSTRAINING = frozenset((
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "contains", "items", "prefixItems", "additionalItems", "unevaluatedItems", "maxProperties",
    "minProperties", "required", "dependentRequired", "dependentSchemas", "dependencies", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "unevaluatedProperties", "$ref",
    "$dynamicRef", "anyOf", "oneOf", "allOf", "not", "if", "then", "else"))
_WHERE_TO_MOVE = {
    "$ref": "move it into the referenced schema",
    "const": "give a value that satisfies it, or drop it",
    "enum": "list only values that satisfy it, or drop it",
    "anyOf": "move it into each branch", "oneOf": "move it into each branch", "allOf": "move it into the schema",
}


def check_no_dropped_siblings(schema: dict, param: str, here: str, root: Any) -> None:
    """Refuse a constraint beside a SCHEMA_REPLACING keyword, which xgrammar would drop.

    The one sound exception: beside `enum`/`const`, a constraint every listed value
    already satisfies (pydantic writes {"enum": [...], "type": "string"}) changes
    nothing, so dropping it is exact."""
    key = next((k for k in SCHEMA_REPLACING if k in schema), None)
    if key is None:
        return
    siblings = {k: v for k, v in schema.items() if k != key and k in CONSTRAINING}
    if not siblings or (key in ("enum", "const") and _all_satisfy(_listed_values(schema, key), siblings, root)):
        return
    sibling = sorted(siblings)[0]
    raise InvalidRequestError(
        f"{param}: the JSON schema keyword {sibling!r} beside {key!r} at {here} is not enforced by Kiln's "
        f"grammar engine (xgrammar), which builds that schema from {key!r} alone; {_WHERE_TO_MOVE[key]}",
        param=param)


def _listed_values(schema: dict, key: str) -> list:
    if key == "const":
        return [schema["const"]]
    return schema["enum"] if isinstance(schema["enum"], list) else []


def _all_satisfy(values: list, siblings: dict, root: Any) -> bool:
    """Whether every value is valid under `siblings` (formats checked, `$ref`s resolved in `root`)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    try:
        # evolve keeps the root's resolver, as jsonschema's own descent into a subschema does
        checker = cls(root, format_checker=cls.FORMAT_CHECKER).evolve(schema=siblings)
        return all(checker.is_valid(value) for value in values)
    except Exception:  # noqa: BLE001 - e.g. a $ref it cannot resolve: not shown to hold, so refused
        return False


def _pointer_token(name: str) -> str:
    """A JSON pointer token (RFC 6901: '~' and '/' escaped)."""
    return str(name).replace("~", "~0").replace("/", "~1")


def check_required_declared(schema: dict, param: str, here: str) -> None:
    """xgrammar enforces `required` only for names its `properties` declare: an
    undeclared one would let the output leave it out (or, with
    additionalProperties false, could never be met)."""
    required, declared = schema.get("required"), schema.get("properties")
    if not isinstance(required, list):
        return
    missing = [name for name in required if not (isinstance(declared, dict) and name in declared)]
    if missing:
        raise InvalidRequestError(
            f"{param}: the JSON schema at {here} requires {missing[0]!r}, which its 'properties' do not declare; "
            f"Kiln's grammar engine (xgrammar) would not enforce it: declare it in 'properties' "
            "({} allows any value)", param=param)


def _problem(error: Exception) -> str:
    """xgrammar's message without its time and source-location prefix."""
    return _LOCATION.sub("", str(error).strip()).strip()
