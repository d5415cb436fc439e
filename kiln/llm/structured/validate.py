"""API-side checks of a GrammarSpec: every problem is a 400 that names it.

JSON schemas are first checked against the JSON Schema meta-schema
(`jsonschema`), then converted by xgrammar (which names what it does not
support); regexes and grammars are parsed by xgrammar. No tokenizer is
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
        check_json_schema(parse_schema_text(spec.value, param), param)
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


def _problem(error: Exception) -> str:
    """xgrammar's message without its time and source-location prefix."""
    return _LOCATION.sub("", str(error).strip()).strip()
