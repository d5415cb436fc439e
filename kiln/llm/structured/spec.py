"""What a request asks its output to follow (no grammar engine imported here)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

# json: a JSON schema (JSON text); json_object: any JSON object (value unused);
# regex; ebnf: xgrammar's EBNF (GBNF dialect, `root ::= ...`); lark: a Lark grammar.
GRAMMAR_KINDS = ("json", "json_object", "regex", "ebnf", "lark")
# A regex, grammar, choice or JSON schema (as JSON text) is compiled per request, on the engine's
# time: every transport caps its size (a 210,000-character regex took 222 s of CPU).
MAX_GRAMMAR_CHARS = 1 << 16


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    value: str = ""

    @property
    def key(self) -> str:
        """Cache key of the compiled grammar."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()


def grammar_syntax(grammar: str) -> str:
    """`ebnf` if the grammar is written with `::=` rules, else `lark` (`rule: ...`)."""
    return "ebnf" if "::=" in grammar else "lark"
