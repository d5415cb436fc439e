"""How a served LLM answers /v1/embeddings (per model; defaults for a command-line model).

A repository `llm` model sets these in its config `parameters` (they are
taken out before the engine options are read):
    embedding_only   true: the model answers /v1/embeddings only (a
                     dedicated embedding checkpoint of a supported family)
    pooling          "last" (default: the last prompt token's hidden state,
                     which has seen the whole prompt) or "mean"
    matryoshka       true: the model was trained so a prefix of its embedding
                     is an embedding; requests may then ask for `dimensions`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import ConfigError

POOLINGS = ("last", "mean")
KEYS = ("embedding_only", "pooling", "matryoshka")


@dataclass(frozen=True)
class EmbeddingSettings:
    embedding_only: bool = False
    pooling: str = "last"
    matryoshka: bool = False

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}", param="pooling")
        for name in ("embedding_only", "matryoshka"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false", param=name)


def split_embedding_settings(parameters: dict[str, Any]) -> tuple[EmbeddingSettings, dict[str, Any]]:
    """(the embedding settings, the remaining parameters: engine options)."""
    mine = {k: v for k, v in parameters.items() if k in KEYS}
    rest = {k: v for k, v in parameters.items() if k not in KEYS}
    return EmbeddingSettings(**mine), rest
