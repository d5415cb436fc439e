"""Limits on what one request may carry; every codec checks them."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 << 20  # HTTP body / gRPC message, after decompression
    max_elements: int = 1 << 28  # elements in one tensor
    max_json_depth: int = 100  # nesting of any JSON body
    max_dims: int = 32  # rank of one tensor

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_elements", "max_json_depth", "max_dims"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be greater than 0", param=name)
