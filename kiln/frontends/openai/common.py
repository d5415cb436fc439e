"""What completions and chat share: parsing, ids, usage, finish fields."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from kiln.frontends.errors import invalid_from_pydantic
from kiln.llm.outputs import RequestOutput

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: dict) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_from_pydantic(e) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Usage:
    """Token counts of one API request: prompts once each, every choice's output."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # the largest prefix-cache hit among the choices

    def add_delta(self, out: RequestOutput) -> None:
        self.completion_tokens += len(out.delta_token_ids)
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)

    def add_final(self, out: RequestOutput) -> None:
        self.completion_tokens += len(out.outputs[0].token_ids)
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def finish_fields(out: RequestOutput) -> dict:
    """finish_reason and vLLM's stop_reason (the stop string or token id, if one ended it)."""
    if not out.finished:
        return {"finish_reason": None, "stop_reason": None}
    completion = out.outputs[0]
    return {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


def now_s() -> int:
    return int(time.time())
