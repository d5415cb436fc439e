"""Chat answers with tool calls: the message of a whole answer, and the deltas of a stream."""

from __future__ import annotations

import uuid
from typing import Any

from kiln.frontends.openai.tools.choice import ToolPlan
from kiln.frontends.openai.tools.parsers import Content, Event, ToolArgs, ToolStart, ToolStream, parse
from kiln.llm.tokenizer import Tokenizer


def tool_parser(tokenizer: Tokenizer, configured: str) -> str:
    """The parser of the model's family: as configured, or read off its chat template."""
    if configured != "auto":
        return configured
    template = tokenizer.chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(engine_reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and engine_reason == "stop" else engine_reason


def answer_message(text: str, plan: ToolPlan) -> dict[str, Any]:
    """The assistant message of a whole answer."""
    if plan.reader is None:
        return {"role": "assistant", "content": text}
    parsed = parse(plan.reader(), text)
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if calls:
        message["tool_calls"] = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


class DeltaReader:
    """One choice's streamed text -> chat deltas (content and tool-call pieces)."""

    def __init__(self, plan: ToolPlan):
        self.stream: ToolStream | None = plan.reader() if plan.reader is not None else None
        self.parallel = plan.parallel
        self.ids: dict[int, str] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        if self.stream is None:
            return {"content": text} if text or not finished else {}
        events = self.stream.feed(text) if text else []
        if finished:
            events += self.stream.finish()
        return self._delta([e for e in events if isinstance(e, Content) or self.parallel or e.index == 0])

    def _delta(self, events: list[Event]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        content = "".join(e.text for e in events if isinstance(e, Content))
        if content:
            out["content"] = content
        calls: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ToolStart):
                self.ids[e.index] = call_id()
                calls.append({"index": e.index, "id": self.ids[e.index], "type": "function",
                              "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, ToolArgs):
                if calls and calls[-1]["index"] == e.index:
                    calls[-1]["function"]["arguments"] += e.text
                else:
                    calls.append({"index": e.index, "function": {"arguments": e.text}})
        if calls:
            out["tool_calls"] = calls
        return out
