"""What one OpenAI request may carry, declared once for every request model.

Two layers, both applied by `strict.Strict` (the base of every request model):

1. Every value anywhere in a body is representable downstream, whatever field
   it sits in (`kiln.frontends.limits.check_representable`, run before field
   validation): valid UTF-8 text, int64 integers, finite numbers. A field
   added later gets this without a line of its own.
2. Each field's own range and size, as the constrained types below: token ids
   and counts in int32, seeds in int64 (a choice's seed + index then still
   fits the engine's uint64), list caps. The server's own limits (max_n,
   max_tokens_limit, max_prompts_per_request, the model's vocabulary and
   context) are checked later, where they are known.

A violation is an InvalidRequestError (400) naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from kiln.frontends.limits import INT64_MAX, INT64_MIN
from kiln.llm.sampling_params import MAX_CACHE_SALT_CHARS, MAX_LOGPROBS
from kiln.llm.structured.spec import MAX_GRAMMAR_CHARS as GRAMMAR_CAP

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

MAX_STOP_STRINGS = 16  # stop strings are searched in the text after every token
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_PROMPT_TOKEN_IDS = 1 << 17  # one prompt as token ids (longer than any context Kiln serves)
MAX_PROMPT_LIST = 4096  # prompts in one body; --max-prompts-per-request is usually far lower
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096
MAX_TOOLS = 128  # OpenAI's own cap; every tool's schema goes into the prompt
MAX_TOOL_CALLS = 128  # calls one earlier assistant message may carry
MAX_CHOICES = 1024  # structured-output choice: one grammar alternative each
MAX_GRAMMAR_CHARS = GRAMMAR_CAP  # a regex, grammar, choice or JSON schema (as JSON text) compiled per request

Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
NonNegativeInt32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
PositiveInt32 = Annotated[int, Field(ge=1, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # -1 or 0: off; above the vocabulary: all of it
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the vocabulary check is the model's
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]
Prompt = (
    str
    | Annotated[list[str], Field(max_length=MAX_PROMPT_LIST)]
    | TokenIds
    | Annotated[list[TokenIds], Field(max_length=MAX_PROMPT_LIST)]
)


def _schema_within_limit(schema: Any) -> Any:
    if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"JSON schema exceeds {MAX_GRAMMAR_CHARS} characters")
    return schema


GrammarText = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]
Schema = Annotated[dict[str, Any], AfterValidator(_schema_within_limit)]
Choices = Annotated[list[GrammarText], Field(max_length=MAX_CHOICES)]
