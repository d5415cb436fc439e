import os

import pytest

from kiln.errors import ConfigError, ModelNotFoundError
from kiln.serving.repository.loader import list_models, read_model
from tests.unit.serving.models import DOUBLER_PY, doubler_config, write_model


def test_reads_versions_by_policy(tmp_path):
    write_model(tmp_path, "m", doubler_config(version_policy={"latest": 2}),
                {1: {"model.py": DOUBLER_PY}, 2: {"model.py": DOUBLER_PY}, 3: {"model.py": DOUBLER_PY}})
    (tmp_path / "m" / "notaversion").mkdir()
    (tmp_path / "m" / "²").mkdir()  # str.isdigit() says yes; int() refused it and the scan failed
    source = read_model(tmp_path, "m")
    assert sorted(source.versions) == [2, 3]
    assert list_models(tmp_path) == ["m"]


def test_missing_model_and_missing_versions(tmp_path):
    with pytest.raises(ModelNotFoundError):
        read_model(tmp_path, "absent")
    write_model(tmp_path, "m", doubler_config())
    with pytest.raises(ConfigError, match="no version directory"):
        read_model(tmp_path, "m")


def test_bad_yaml_and_traversal_names(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.yaml").write_text("backend: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_model(tmp_path, "m")
    with pytest.raises(ConfigError):
        read_model(tmp_path, "../m")


def test_symlink_escaping_the_repository_is_refused(tmp_path):
    outside = tmp_path / "outside"
    write_model(outside, "m", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    repo = tmp_path / "repo"
    repo.mkdir()
    os.symlink(outside / "m", repo / "m")
    with pytest.raises(ConfigError, match="outside"):
        read_model(repo, "m")


def test_a_config_yaml_symlinked_out_of_the_repository_is_refused(tmp_path):
    # It loaded: the only path of a model that was not held inside the repository.
    repo = tmp_path / "repo"
    write_model(repo, "m", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    elsewhere = tmp_path / "elsewhere.yaml"
    (repo / "m" / "config.yaml").rename(elsewhere)
    os.symlink(elsewhere, repo / "m" / "config.yaml")
    with pytest.raises(ConfigError, match="'config.yaml' resolves outside the model repository"):
        read_model(repo, "m")
    (repo / "m" / "config.yaml").unlink()
    elsewhere.rename(repo / "shared.yaml")  # a link that stays inside the repository is fine
    os.symlink(repo / "shared.yaml", repo / "m" / "config.yaml")
    assert read_model(repo, "m").config.backend == "python"
