"""Tool fields of a chat request, validated into one ToolRequest."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kiln.frontends.openai.limits import MAX_TOOLS, Schema
from kiln.frontends.openai.strict import Strict


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: Schema | None = None  # a JSON schema: compiled when the tool is forced
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(Strict):
    """Mixed into the chat request."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
