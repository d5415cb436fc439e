"""A checkpoint's generation_config.json defaults, for requests that leave them unset.

Honoured fields: `eos_token_id` (extra stop tokens; read with the
architecture, see hf_loader.generation_eos_ids) and the sampling defaults
here: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`. With
`do_sample: false` the model's default is greedy (temperature 0), as in
transformers' generate(). An OpenAI request's own value always wins; a field
it leaves unset takes the checkpoint's default, else the API's default.
Other fields (max_new_tokens, beams, ...) are not applied.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


def load_generation_defaults(model_path: str | Path) -> GenerationDefaults:
    """The defaults in `model_path`/generation_config.json (a HF directory);
    none for a GGUF file or a directory without one. A malformed file is
    logged and ignored: it must not stop a model that otherwise loads."""
    path = Path(model_path) / GENERATION_CONFIG
    if not path.is_file():
        return GenerationDefaults()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return defaults_from(config if isinstance(config, dict) else {})
    except (OSError, ValueError, TypeError) as e:
        log.warning("ignoring %s: %s", path, e)
        return GenerationDefaults()


def defaults_from(config: dict[str, Any]) -> GenerationDefaults:
    if config.get("do_sample") is False:
        return GenerationDefaults(temperature=0.0, repetition_penalty=_float(config.get("repetition_penalty")))
    top_k = config.get("top_k")
    return GenerationDefaults(
        temperature=_float(config.get("temperature")),
        top_p=_float(config.get("top_p")),
        top_k=None if top_k is None else int(top_k),
        min_p=_float(config.get("min_p")),
        repetition_penalty=_float(config.get("repetition_penalty")),
    )


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
