"""Scans one JSON object as it streams in: its top-level string values (the
function name) and the raw text of one key's value (the arguments).

The arguments are reported as the model wrote them, so the deltas streamed
for a call concatenate to exactly the `arguments` string of the whole answer.
"""

from __future__ import annotations

import json


class ObjectScanner:
    def __init__(self, value_keys: tuple[str, ...]):
        self.value_keys = value_keys
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string_start = -1
        self.key: str | None = None  # the top-level key whose value comes next / is being read
        self.expect = "open"  # open | key | colon | value | after_value
        self.strings: dict[str, str] = {}
        self.value_start: int | None = None
        self.value_end: int | None = None
        self.end: int | None = None  # index after the closing brace, once complete
        self.error = False

    @property
    def done(self) -> bool:
        return self.end is not None

    def value_text(self) -> str:
        """The argument value's text so far (all of it once the value closed)."""
        if self.value_start is None:
            return ""
        stop = self.value_end if self.value_end is not None else self.pos
        return self.text[self.value_start : stop]

    def feed(self, text: str) -> None:
        self.text += text
        while self.pos < len(self.text) and not self.done and not self.error:
            self._step(self.text[self.pos])
            self.pos += 1

    def _step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self._string_closed()
            return
        if self.expect == "open":
            if ch == "{":
                self.depth, self.expect = 1, "key"
            elif not ch.isspace():
                self.error = True
            return
        if self.depth > 1:  # inside a nested value
            self._nested(ch)
            return
        if ch.isspace():
            return
        if self.expect == "key":
            if ch == '"':
                self.in_string, self.string_start = True, self.pos
            elif ch == "}":
                self._close()
            else:
                self.error = True
        elif self.expect == "colon":
            self.expect = "value" if ch == ":" else self.expect
            self.error = ch != ":"
        elif self.expect == "value":
            if self.key in self.value_keys:
                self.value_start = self.pos
            if ch == '"':
                self.in_string, self.string_start = True, self.pos
            elif ch in "{[":
                self.depth += 1
            self.expect = "after_value"
        elif self.expect == "after_value" and ch in ",}":
            if self.value_start is not None and self.value_end is None and self.key in self.value_keys:
                self.value_end = self.pos
                while self.value_end > self.value_start and self.text[self.value_end - 1].isspace():
                    self.value_end -= 1
            if ch == "}":
                self._close()
            else:
                self.expect = "key"

    def _nested(self, ch: str) -> None:
        if ch == '"':
            self.in_string, self.string_start = True, -1
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _string_closed(self) -> None:
        if self.depth != 1 or self.string_start < 0:
            return
        try:
            value = json.loads(self.text[self.string_start : self.pos + 1])
        except json.JSONDecodeError:
            self.error = True
            return
        if self.expect == "key":
            self.key, self.expect = value, "colon"
        elif self.expect == "after_value" and self.key is not None:
            self.strings[self.key] = value

    def _close(self) -> None:
        self.depth = 0
        self.end = self.pos + 1
