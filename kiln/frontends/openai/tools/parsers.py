"""Model output -> content and tool calls, incrementally (one path for
streamed and whole answers: `parse` feeds everything, then finishes).

Families:
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one
               or more, after optional content (Hermes, Qwen 2/2.5/3, and
               Kiln's own prompt for templates without tool support)
  llama3_json  {"name": ..., "parameters": {...}} (several joined by ";"),
               the whole output, optionally after <|python_tag|> (Llama 3.1+)
  kiln_json    Kiln's enforced format for tool_choice "required": a JSON array
               of {"name", "parameters"} objects (see choice.py)
  named        tool_choice naming a function: the output is its arguments

Events: Content(text), ToolStart(index, name), ToolArgs(index, text). A
call's ToolArgs concatenate to exactly its final `arguments`.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field

from kiln.frontends.openai.tools.scanner import ObjectScanner

PARSERS = ("hermes", "llama3_json")


@dataclass
class Content:
    text: str


@dataclass
class ToolStart:
    index: int
    name: str


@dataclass
class ToolArgs:
    index: int
    text: str


Event = Content | ToolStart | ToolArgs


@dataclass
class ParsedCall:
    name: str
    arguments: str


@dataclass
class Parsed:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class CallReader:
    """One call object: emits its name once known, then its arguments as they grow."""

    def __init__(self, index: int, args_keys: tuple[str, ...]):
        self.index = index
        self.scanner = ObjectScanner(args_keys)
        self.named = False
        self.sent = 0

    def feed(self, text: str) -> list[Event]:
        self.scanner.feed(text)
        return self._events()

    def _events(self) -> list[Event]:
        events: list[Event] = []
        s = self.scanner
        if not self.named and "name" in s.strings:
            self.named = True
            events.append(ToolStart(self.index, s.strings["name"]))
        if self.named:
            value = s.value_text()
            if s.value_end is None and not s.done:
                value = value.rstrip()  # trailing whitespace may not belong to the value
            if len(value) > self.sent:
                events.append(ToolArgs(self.index, value[self.sent :]))
                self.sent = len(value)
        return events

    @property
    def rest(self) -> str:
        """Text fed after the object closed."""
        s = self.scanner
        return s.text[s.end :] if s.end is not None else ""


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


HERMES_ARGS_KEYS = ("arguments", "parameters")


def read_hermes_call(raw: str, tool_names: Collection[str] | None) -> ParsedCall | None:
    """The call written between the tags, or None when it is not a valid call of a
    known function (vLLM then answers the text as content): not one JSON object,
    no string `name` among the request's tools (None: any), no arguments object.
    The arguments are the model's own text of that object."""
    try:
        call = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    if tool_names is not None and call["name"] not in tool_names:
        return None
    key = next((k for k in HERMES_ARGS_KEYS if k in call), None)
    if key is None or not isinstance(call[key], dict):
        return None
    scanner = ObjectScanner((key,))
    scanner.feed(raw.strip())
    return ParsedCall(call["name"], scanner.value_text())


class HermesStream:
    """Each call is held until its end tag (or the output's end), then sent whole if
    valid (read_hermes_call) and as content with its tags if not: a stream cannot
    take back a call it began, so this is how streamed and whole answers agree."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.tool_names = tool_names
        self.buf = ""
        self.in_call = False  # buf then holds the call's text after its start tag
        self.scanner = ObjectScanner(HERMES_ARGS_KEYS)
        self.scanned = 0  # how much of buf the scanner has read
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            if not self.in_call:
                at = self.buf.find(self.START)
                if at < 0:
                    keep = _held_prefix(self.buf, self.START)
                    out = self.buf[: len(self.buf) - keep]
                    if out and (out.strip() or not self.num_calls):  # whitespace between calls is held
                        events.append(Content(out))
                        self.buf = self.buf[len(out) :]
                    return events
                if self.buf[:at].strip() or (at and not self.num_calls):
                    events.append(Content(self.buf[:at]))
                self.buf = self.buf[at + len(self.START) :]
                self.in_call, self.scanner, self.scanned = True, ObjectScanner(HERMES_ARGS_KEYS), 0
            else:
                bounds = self._call_bounds()
                if bounds is None:
                    return events
                events += self._call_events(self.buf[: bounds[0]], closed=True)
                self.buf, self.in_call = self.buf[bounds[1] :], False

    def _call_bounds(self) -> tuple[int, int] | None:
        """(index of its end tag, index after it), once the call's end tag is in buf.
        While the object is open and well formed, an end tag may sit in one of its
        strings, so only the scanner's end of object (or its giving up) is trusted."""
        self.scanner.feed(self.buf[self.scanned :])
        self.scanned = len(self.buf)
        s = self.scanner
        if s.done:
            assert s.end is not None
            tail = self.buf[s.end :]
            after = tail.lstrip()
            if after.startswith(self.END):
                at = len(self.buf) - len(after)
                return at, at + len(self.END)
            if self.END.startswith(after):
                return None  # the end tag may still come
        elif not s.error:
            return None
        at = self.buf.find(self.END)  # a malformed call: it runs to the first end tag
        return None if at < 0 else (at, at + len(self.END))

    def _call_events(self, raw: str, closed: bool) -> list[Event]:
        call = read_hermes_call(raw, self.tool_names)
        if call is None:
            return [Content(self.START + raw + (self.END if closed else ""))]
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [ToolStart(index, call.name), ToolArgs(index, call.arguments)]

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self.in_call:  # a call still open: it runs to the first end tag, or to the end
            at = self.buf.find(self.END)
            raw, self.buf = (self.buf, "") if at < 0 else (self.buf[:at], self.buf[at + len(self.END) :])
            self.in_call = False
            events += self._call_events(raw, closed=at >= 0)
            events += self.feed("")
        if self.buf and (self.buf.strip() or not self.num_calls):
            events.append(Content(self.buf))
            self.buf = ""
        return events


class Llama3JsonStream:
    def __init__(self) -> None:
        self.buf = ""
        self.mode: str | None = None  # None until the first non-space character; then content | calls
        self.call: CallReader | None = None
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip().removeprefix("<|python_tag|>").lstrip()
            if not head or "<|python_tag|>".startswith(self.buf.lstrip()):
                return []
            self.mode = "calls" if head.startswith("{") else "content"
            if self.mode == "calls":
                self.buf = head
        if self.mode == "content":
            out, self.buf = self.buf, ""
            return [Content(out)] if out else []
        events: list[Event] = []
        while self.buf:
            if self.call is None:
                stripped = self.buf.lstrip().lstrip(";").lstrip()
                if not stripped:
                    self.buf = ""
                    break
                self.buf = stripped
                self.call = CallReader(self.num_calls, ("parameters", "arguments"))
                self.num_calls += 1
            text, self.buf = self.buf, ""
            events += self.call.feed(text)
            if not self.call.scanner.done:
                break
            self.buf, self.call = self.call.rest, None
        return events

    def finish(self) -> list[Event]:
        return [Content(self.buf)] if self.mode == "content" and self.buf else []


class KilnJsonStream:
    """The enforced array of {"name", "parameters"} objects (tool_choice required)."""

    def __init__(self) -> None:
        self.buf = ""
        self.opened = False
        self.call: CallReader | None = None
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while self.buf:
            if not self.opened:
                stripped = self.buf.lstrip()
                if not stripped:
                    break
                self.buf, self.opened = stripped[1:], True  # the grammar guarantees "["
                continue
            if self.call is None:
                stripped = self.buf.lstrip().lstrip(",").lstrip()
                if not stripped or stripped.startswith("]"):
                    self.buf = ""
                    break
                self.buf = stripped
                self.call = CallReader(self.num_calls, ("parameters",))
                self.num_calls += 1
            text, self.buf = self.buf, ""
            events += self.call.feed(text)
            if not self.call.scanner.done:
                break
            self.buf, self.call = self.call.rest, None
        return events

    def finish(self) -> list[Event]:
        return []


class NamedStream:
    """tool_choice names the function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            self.started = True
            events.append(ToolStart(0, self.name))
        if text:
            events.append(ToolArgs(0, text))
        return events

    def finish(self) -> list[Event]:
        return [] if self.started else [ToolStart(0, self.name)]


ToolStream = HermesStream | Llama3JsonStream | KilnJsonStream | NamedStream


def make_stream(parser: str, tool_names: Collection[str] | None = None) -> ToolStream:
    """A stream for the family's format; `tool_names` (None: any) are the functions
    a hermes call may name."""
    if parser == "llama3_json":
        return Llama3JsonStream()
    if parser == "hermes":
        return HermesStream(tool_names)
    raise ValueError(f"unknown tool parser {parser!r}")


def collate(events: list[Event]) -> Parsed:
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, ParsedCall] = {}
    for e in events:
        if isinstance(e, ToolStart):
            calls[e.index] = ParsedCall(e.name, "")
        elif isinstance(e, ToolArgs):
            calls[e.index].arguments += e.text
    # The content exactly as it streams (whitespace beside a call included), so a
    # whole answer and the join of its stream agree.
    return Parsed(content or None, [calls[i] for i in sorted(calls)])


def parse(stream: ToolStream, text: str) -> Parsed:
    return collate(stream.feed(text) + stream.finish())
