"""Incremental detokenization: token ids in, newly completed text out.

Technique (as in vLLM / TGI): keep two offsets into the ids.
  ids[prefix_offset:read_offset]  already emitted; decoded again only as
                                  context, because a token's text can depend
                                  on its left neighbour (SentencePiece drops
                                  the leading space of the first token);
  ids[read_offset:]               not emitted yet.
Each step decodes the window ids[prefix_offset:] and emits what it adds to
the context's text. A window whose text ends in U+FFFD may stop in the
middle of a multi-byte UTF-8 character, so nothing is emitted until later
tokens complete it (or `finish` flushes it).

Invariant: `read_offset` only moves to a point where the text so far ends
with a whole character, so every window starts at a character boundary and
the emitted pieces concatenate to `tokenizer.decode(ids)`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What detokenization needs of a tokenizer (kiln.llm.tokenizer.Tokenizer has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until `finish`)."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, new_ids: Sequence[int]) -> str:
        """Feed the next token ids; return the text they completed (maybe "")."""
        self._ids.extend(new_ids)
        context = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(context) or window.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new, or a character still incomplete
        delta = window[len(context) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def finish(self) -> str:
        """Emit whatever was held back (ending in U+FFFD if truly incomplete)."""
        context = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        delta = window[len(context) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
