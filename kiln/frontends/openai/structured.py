"""Structured outputs on the OpenAI routes: request fields -> one GrammarSpec.

    response_format      {"type": "text" | "json_object"} or
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   Kiln/vLLM extension: exactly one of json (a schema),
                         regex, choice (a list of strings), grammar (EBNF with
                         `::=` rules, else Lark), json_object (true)
    guided_json / guided_regex / guided_choice / guided_grammar
                         the same, under vLLM's older flat names

At most one of them may constrain a request; every problem is a 400 naming
the field (kiln.llm.structured.validate checks the grammar itself).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import ConfigDict, Field

from kiln.errors import InvalidRequestError
from kiln.frontends.openai.limits import Choices, GrammarText, Schema
from kiln.frontends.openai.strict import Strict
from kiln.llm.structured.spec import GrammarSpec, grammar_syntax
from kiln.llm.structured.validate import check_spec


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    # OpenAI's rule for the name (letters, digits, '_' and '-', at most 64)
    name: str = Field(default="response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(Strict):
    json_: Schema | GrammarText | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StructuredFields(Strict):
    """The request fields that ask for structured output (mixed into SamplingFields)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Schema | GrammarText | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None


def requested_specs(req: StructuredFields) -> list[tuple[str, GrammarSpec]]:
    """(field, spec) for every constraint the request sets."""
    found: list[tuple[str, GrammarSpec]] = []
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema", param="response_format.json_schema"
                )
            found.append(("response_format", GrammarSpec("json", json.dumps(rf.json_schema.schema_))))
        elif rf.json_schema is not None:
            raise InvalidRequestError(
                f"response_format.json_schema is only for type json_schema, not {rf.type!r}", param="response_format"
            )
        elif rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
    so = req.structured_outputs
    if so is not None:
        found += [(f"structured_outputs.{name}", spec) for name, spec in _flat_specs(
            so.json_, so.regex, so.choice, so.grammar, bool(so.json_object))]
    found += [(f"guided_{name}", spec) for name, spec in _flat_specs(
        req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar, False)]
    return found


def _flat_specs(
    schema: dict | str | None, regex: str | None, choice: list[str] | None, grammar: str | None, json_object: bool
) -> list[tuple[str, GrammarSpec]]:
    out = []
    if schema is not None:
        out.append(("json", GrammarSpec("json", schema if isinstance(schema, str) else json.dumps(schema))))
    if regex is not None:
        out.append(("regex", GrammarSpec("regex", regex)))
    if choice is not None:
        out.append(("choice", choice_grammar(choice)))
    if grammar is not None:
        out.append(("grammar", GrammarSpec(grammar_syntax(grammar), grammar)))
    if json_object:
        out.append(("json_object", GrammarSpec("json_object")))
    return out


def choice_grammar(choices: list[str]) -> GrammarSpec:
    """Exactly one of the strings (an EBNF alternation of literals).

    A JSON string literal is an EBNF one (`"`, `\\` and control characters
    escaped); ensure_ascii=False keeps a character outside the BMP whole, which
    xgrammar would read as two code points from a surrogate-pair escape."""
    if not choices:
        raise InvalidRequestError("choice must list at least one string", param="structured_outputs.choice")
    return GrammarSpec("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def grammar_spec(req: StructuredFields) -> tuple[str, GrammarSpec] | None:
    """The request's one constraint (field name, checked spec), or None."""
    specs = requested_specs(req)
    if len(specs) > 1:
        names = ", ".join(name for name, _ in specs)
        raise InvalidRequestError(f"set at most one structured-output constraint, got {names}", param=specs[1][0])
    if not specs:
        return None
    name, spec = specs[0]
    check_spec(spec, name)
    return name, spec
