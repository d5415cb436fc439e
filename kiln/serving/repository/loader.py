"""Reading a model repository from disk.

Layout: `<repo>/<model>/config.yaml` and `<repo>/<model>/<version>/<artifact>`.
Invariant: every path returned here resolves (symlinks included) to a place
inside the repository root; anything else is refused with ConfigError.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kiln.config_text import load_yaml
from kiln.errors import ConfigError, ModelNotFoundError
from kiln.serving.repository.config import RepositoryModelConfig, check_model_name, parse_config
from kiln.serving.repository.triton_format import from_triton, is_triton_form

CONFIG_FILE = "config.yaml"
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """A model as found on disk: its config and the versions to load."""

    name: str
    config: RepositoryModelConfig
    directory: Path | None  # None: a model added in memory (no files)
    versions: dict[int, Path | None]  # version -> version dir, chosen by the policy


def _inside(root: Path, path: Path) -> Path:
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise ConfigError(f"path {path.name!r} resolves outside the model repository")
    return resolved


def list_models(repository: Path) -> list[str]:
    """Names of the model directories in the repository (sorted)."""
    root = Path(repository).resolve()
    if not root.is_dir():
        raise ConfigError(f"model repository {str(repository)!r} is not a directory")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def read_config_file(path: Path, name: str) -> RepositoryModelConfig:
    if not path.is_file():
        raise ConfigError(f"model '{name}' has no {CONFIG_FILE}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{CONFIG_FILE} of model '{name}' is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CONFIG_FILE} of model '{name}' is not valid YAML: {exc}") from None
    return parse_config(data if data is not None else {}, name=name)


def find_versions(directory: Path, root: Path) -> dict[int, Path]:
    """All numbered version dirs of a model directory."""
    versions: dict[int, Path] = {}
    names: dict[int, str] = {}
    for child in sorted(directory.iterdir()):
        if child.is_dir() and child.name.isascii() and child.name.isdigit() and int(child.name) > 0:
            version = int(child.name)
            if version in versions:  # '1' and '01': which one served would depend on the listing order
                raise ConfigError(f"version directories '{names[version]}' and '{child.name}' of "
                                  f"'{directory.name}' are both version {version}")
            versions[version], names[version] = _inside(root, child), child.name
    return versions


def read_model(repository: Path, name: str, override: dict[str, Any] | None = None) -> ModelSource:
    """Read one model; `override` replaces its config.yaml (load API)."""
    check_model_name(name)
    root = Path(repository).resolve()
    directory = root / name
    if not directory.is_dir():
        raise ModelNotFoundError(f"model '{name}' is not in the model repository")
    directory = _inside(root, directory)
    if override is not None and is_triton_form(override):  # what GET .../config answered, maybe edited
        config_file = directory / CONFIG_FILE
        base = read_config_file(_inside(root, config_file), name) if config_file.is_file() else None
        override = from_triton(override, base)
    if override is not None:
        config = parse_config(override, name=name)
    else:  # a config.yaml symlinked out of the repository is refused like any other path
        config_file = directory / CONFIG_FILE
        config = read_config_file(_inside(root, config_file) if config_file.exists() else config_file, name)
    available = find_versions(directory, root)
    if config.backend == "ensemble":
        # An ensemble has no artifacts; its one version is 1 unless dirs say otherwise.
        available = available or {1: directory}
    chosen = config.version_policy.select(list(available))
    if not chosen:
        raise ConfigError(
            f"model '{name}' has no version directory matching its version policy "
            f"(found {sorted(available) or 'none'})"
        )
    return ModelSource(name, config, directory, {v: available[v] for v in chosen})


def artifact_path(source_dir: Path | None, artifact: str) -> Path:
    """The artifact file inside a version dir; it must exist and stay inside."""
    if source_dir is None:
        raise ConfigError(f"artifact {artifact!r} needs a model directory; this model has none")
    path = source_dir / artifact
    if not path.exists():
        raise ConfigError(f"artifact {artifact!r} not found in version directory {source_dir.name!r}")
    return _inside(source_dir.parent.parent.resolve(), path)
