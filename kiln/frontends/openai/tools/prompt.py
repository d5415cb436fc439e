"""Chat messages (with tools) -> the dicts a chat template renders.

A template that knows tools (it mentions `tools`) gets them as the
`tools` variable, assistant tool calls with their arguments as objects, and
tool results as role "tool" messages with their `tool_call_id`. A template
that does not (SmolLM2's, for one) gets Kiln's description of the tools in the
system message, in the Hermes format the default parser reads, and earlier
calls and results as text.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.frontends.openai.tools.protocol import Tool, ToolCall

TOOL_SYSTEM_PROMPT = (
    "You can call functions. The available functions, as JSON schemas, are:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one <tool_call></tool_call> block per call, each holding a JSON object "
    'with the function\'s name and arguments:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<arguments-object>}}\n</tool_call>"
)


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def arguments_object(arguments: str) -> Any:
    """Arguments as an object for templates that serialize them (kept as text if not JSON)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def calls_as_text(calls: list[ToolCall]) -> str:
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": c.function.name, "arguments": arguments_object(c.function.arguments)})
        + "\n</tool_call>"
        for c in calls
    )


def _described(tools: list[Tool]) -> str:
    return TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t.function.model_dump(exclude_none=True))
                                                     for t in tools))


def with_tools_described(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """Kiln's tool description merged into (or placed as) the system message."""
    described = _described(tools)
    if messages and messages[0]["role"] == "system":  # message_dict made `developer` `system`
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def tools_in_first_turn(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """Kiln's tool description at the top of the first user turn (templates without a system role)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        return with_tools_described(messages, tools)  # nowhere else to put it: the template's error stands
    out = list(messages)
    out[first] = {**messages[first], "content": f"{_described(tools)}\n\n{messages[first]['content']}"}
    return out


def message_dict(message: Any, knows_tools: bool) -> dict[str, Any]:
    """One ChatMessage as the template sees it: OpenAI's `developer` as `system`, the
    role templates know (one that only knows `system` dropped it or refused it)."""
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        if knows_tools:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": arguments_object(c.function.arguments)}}
                for c in message.tool_calls
            ]
        else:
            out["content"] = "\n".join(filter(None, [out["content"], calls_as_text(message.tool_calls)]))
    if message.role == "tool":
        if knows_tools:
            out["tool_call_id"] = message.tool_call_id
        else:
            out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
    return out
