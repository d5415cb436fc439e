"""The base of every OpenAI request model: unknown fields and loose types are 400s,
and every value anywhere in a body is representable downstream (limits.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from kiln.frontends.limits import check_representable


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _representable(cls, data: Any) -> Any:
        check_representable(data)
        return data
