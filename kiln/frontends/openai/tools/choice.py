"""tool_choice -> what is rendered, what is enforced, how output is read.

  none       tools are not rendered; output is plain content
  auto       tools rendered; output parsed by the model family's parser
  required   a grammar forces a JSON array of {"name", "parameters"} calls
             (one call when parallel_tool_calls is false), each name one of
             the tools and its parameters valid under that tool's schema
  named      a grammar forces the named function's arguments (its schema)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import InvalidRequestError
from kiln.frontends.openai.tools.parsers import KilnJsonStream, NamedStream, ToolStream, make_stream
from kiln.frontends.openai.tools.protocol import NamedToolChoice, Tool, ToolFields
from kiln.llm.structured.spec import GrammarSpec
from kiln.llm.structured.validate import check_enforceable, check_json_schema

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# OpenAI: a function whose `parameters` are omitted takes none, so `{}` is its only arguments.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema a forced call's arguments follow: NO_PARAMETERS when `parameters`
    is omitted; an empty schema ({}) still asks for an object (arguments are one)."""
    parameters = tool.function.parameters
    if parameters is None:
        return NO_PARAMETERS
    return parameters or ANY_OBJECT


@dataclass
class ToolPlan:
    tools: list[Tool] = field(default_factory=list)  # rendered into the prompt
    spec: GrammarSpec | None = None  # enforced by the grammar engine
    reader: Callable[[], ToolStream] | None = None  # reads calls out of the output; None: plain content
    parallel: bool = True


def plan_tools(req: ToolFields, parser: str) -> ToolPlan:
    tools = req.tools or []
    if req.tool_choice is not None and not tools:
        raise InvalidRequestError("tool_choice is only allowed when tools are given", param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    for i, given in enumerate(tools):
        if given.function.parameters is not None:
            check_json_schema(given.function.parameters, f"tools[{i}].function.parameters")
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        return ToolPlan(tools, None, lambda: make_stream(parser, names), req.parallel_tool_calls)
    if isinstance(choice, NamedToolChoice):
        by_name = {t.function.name: t for t in tools}
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise InvalidRequestError(
                f"tool_choice names function {choice.function.name!r}, which is not among the tools ({names})",
                param="tool_choice",
            )
        check_enforceable(tool.function.parameters, f"tools[{names.index(tool.function.name)}].function.parameters")
        spec = GrammarSpec("json", json.dumps(arguments_schema(tool)))
        return ToolPlan(tools, spec, lambda: NamedStream(tool.function.name), False)
    for i, given in enumerate(tools):  # "required": every tool's arguments go through the grammar
        check_enforceable(given.function.parameters, f"tools[{i}].function.parameters")
    return ToolPlan(tools, required_grammar(tools, req.parallel_tool_calls), KilnJsonStream, req.parallel_tool_calls)


def required_grammar(tools: list[Tool], parallel: bool) -> GrammarSpec:
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": arguments_schema(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json", json.dumps(schema))


def check_against_structured(plan: ToolPlan, structured_field: str | None) -> None:
    if plan.spec is not None and structured_field is not None:
        raise InvalidRequestError(
            f"{structured_field} cannot be combined with a tool_choice that forces a call", param=structured_field
        )
