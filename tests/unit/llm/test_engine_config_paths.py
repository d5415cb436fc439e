"""Path objects for EngineConfig's text options (`LLM(draft_model=Path(...))`)."""
from pathlib import Path

import pytest

from kiln.config import EngineConfig
from kiln.errors import ConfigError


def test_a_path_object_is_taken_as_its_text_for_every_path_option(tmp_path):
    config = EngineConfig.from_flat(model=tmp_path / "m.gguf", draft_model=tmp_path / "draft", spec_method="draft")
    assert config.model.model == str(tmp_path / "m.gguf")
    assert config.spec.draft_model == str(tmp_path / "draft")
    assert EngineConfig.from_flat(spec_method="draft", draft_model=str(tmp_path)) == EngineConfig.from_flat(
        spec_method="draft", draft_model=tmp_path)


def test_a_path_object_for_a_number_is_still_refused_by_name():
    with pytest.raises(ConfigError, match=r"max_num_seqs must be int, got PosixPath"):
        EngineConfig.from_flat(max_num_seqs=Path("8"))
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig.from_flat(dtype=Path("bfloat16x"))


def test_an_empty_model_path_is_refused_not_taken_as_the_default():
    # `kiln generate ""` and LLM("") served the installed SmolLM2 without a word.
    with pytest.raises(ConfigError, match="model must not be empty"):
        EngineConfig.from_flat(model="")
