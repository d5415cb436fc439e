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


def check_enforceable(schema: Any, param: str, where: str = "") -> None:
    """Refuse a keyword the grammar engine would silently drop, naming it and where it is."""
    if not isinstance(schema, dict):
        return
    here = where or "(root)"
    for key in UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            raise InvalidRequestError(
                f"{param}: the JSON schema keyword {key!r} at {here} is not enforced by Kiln's grammar engine "
                "(xgrammar); remove it and check it after generation", param=param)
    if "format" in schema and ("minLength" in schema or "maxLength" in schema):
        raise InvalidRequestError(
            f"{param}: minLength/maxLength beside 'format' at {here} are not enforced by Kiln's grammar engine "
            "(xgrammar); use one or the other", param=param)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise InvalidRequestError(
            f"{param}: 'allOf' with more than one schema at {here} is not enforced by Kiln's grammar engine "
            "(xgrammar); merge the schemas into one", param=param)
    check_required_declared(schema, param, here)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_enforceable(sub, param, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_enforceable(sub, param, f"{where}/{key}/{i}")
    for key in _SCHEMA_VALUES:
        value = schema.get(key)
        for i, sub in enumerate(value if isinstance(value, list) else [value]):  # items: a list in old drafts
            check_enforceable(sub, param, f"{where}/{key}" + (f"/{i}" if isinstance(value, list) else ""))


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
