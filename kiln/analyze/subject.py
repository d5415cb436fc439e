"""What is analyzed: a repository model, or an LLM given as a model file.

A subject knows its search space, how to start `kiln serve` with one
configuration, the model-control `config` that switches a running server to
another, and how to write a configuration as a ready-to-use file.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Protocol

import yaml

from kiln.analyze.space import (
    Config,
    SearchSpace,
    apply_llm,
    apply_repository,
    llm_space,
    repository_space,
)
from kiln.config_text import load_yaml
from kiln.errors import ConfigError
from kiln.serving.repository.config import check_model_name, parse_config

CONFIG_FILE = "config.yaml"
SERVE_SCRIPT = "serve-command.sh"


class Subject(Protocol):
    kind: str
    name: str  # the model's name on the server
    space: SearchSpace

    def fingerprint(self) -> dict[str, Any]: ...
    def problem(self, config: Config) -> str | None: ...
    def serve_args(self, config: Config, workdir: Path) -> list[str]: ...
    def load_config(self, config: Config) -> dict[str, Any]: ...
    def write(self, config: Config, directory: Path, header: str) -> list[Path]: ...


def _header_comment(header: str) -> str:
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())


class RepositorySubject:
    kind = "repository"

    def __init__(self, repository: str | Path, name: str):
        self.repository = Path(repository)
        self.name = check_model_name(name)
        self.directory = self.repository / name
        path = self.directory / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"model {name!r} has no {CONFIG_FILE} in {self.repository}")
        try:
            raw = load_yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping")
        self.raw: dict[str, Any] = raw
        self.space = repository_space(raw)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": str(self.directory.resolve()), "base": self.raw}

    def load_config(self, config: Config) -> dict[str, Any]:
        return apply_repository(self.raw, config)

    def problem(self, config: Config) -> str | None:
        try:
            parse_config(self.load_config(config), name=self.name)
        except ConfigError as exc:
            return exc.message
        return None

    def serve_args(self, config: Config, workdir: Path) -> list[str]:
        """A repository holding only this model (linked, not copied, where the file system allows)."""
        repository = workdir / "repository"
        target = repository / self.name
        if not target.exists():
            shutil.copytree(self.directory, target, copy_function=_link_or_copy)
        # A new file, never a write through the hard link to the user's own config.yaml.
        (target / CONFIG_FILE).unlink(missing_ok=True)
        (target / CONFIG_FILE).write_text(yaml.safe_dump(self.load_config(config), sort_keys=False))
        return ["--model-repository", str(repository)]

    def write(self, config: Config, directory: Path, header: str) -> list[Path]:
        path = directory / CONFIG_FILE
        path.write_text(_header_comment(header) + yaml.safe_dump(self.load_config(config), sort_keys=False))
        return [path]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class LLMSubject:
    kind = "llm"

    def __init__(self, model: str | None, base_options: dict[str, Any]):
        self.model = model
        self.base_options = {k: v for k, v in base_options.items() if k != "model"}
        if model is not None:
            self.base_options["model"] = model
        self.space = llm_space(self.base_options)
        path = Path(model) if model else None
        self.name = (path.stem if path.suffix == ".gguf" else path.name) if path else "llm"

    def fingerprint(self) -> dict[str, Any]:
        model = str(Path(self.model).resolve()) if self.model else "default (the installed SmolLM2 GGUF)"
        return {"kind": self.kind, "model": model, "base": {k: v for k, v in self.base_options.items() if k != "model"}}

    def options(self, config: Config) -> dict[str, Any]:
        return apply_llm(self.base_options, config)

    def problem(self, config: Config) -> str | None:
        try:
            self.options(config)
        except ConfigError as exc:
            return exc.message
        return None

    def load_config(self, config: Config) -> dict[str, Any]:
        return {"backend": "llm", "parameters": self.options(config)}

    def flags(self, config: Config) -> list[str]:
        options = self.options(config)
        args = [str(options.pop("model"))] if "model" in options else []
        for key, value in options.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            else:
                args += [flag, str(value)]
        return args

    def serve_args(self, config: Config, workdir: Path) -> list[str]:
        return [*self.flags(config), "--served-model-name", self.name]

    def write(self, config: Config, directory: Path, header: str) -> list[Path]:
        script = directory / SERVE_SCRIPT
        command = shlex.join(["kiln", "serve", *self.flags(config), "--served-model-name", self.name])
        script.write_text("#!/bin/sh\n" + _header_comment(header) + f'exec {command} "$@"\n')
        script.chmod(0o755)
        # The same engine options as a repository model (backend llm, options as parameters).
        repo_config = directory / CONFIG_FILE
        doc = {"backend": "llm", "parameters": self.options(config)}
        repo_config.write_text(_header_comment(header) + yaml.safe_dump(doc, sort_keys=False))
        return [script, repo_config]
