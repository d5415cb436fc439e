"""Entry points the main CLI wires up:

- `kiln serve --model-repository DIR ...` -> `serve_repository(args)`
- `kiln repo validate DIR`                -> `validate_repository(DIR)`

`validate_repository` never runs user code: it parses every config, checks
versions and artifacts, reads ONNX signatures (for configs without inputs)
and checks every ensemble's graph.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from kiln.errors import KilnError
from kiln.serving.ensemble.dag import validate_ensemble
from kiln.serving.repository.config import ModelConfig
from kiln.serving.repository.loader import ModelSource, list_models, read_model
from kiln.serving.server import add_arguments, options_from_args, serve

DEFAULT_ARTIFACTS = {"onnxruntime": ("model.onnx",), "torch": ("model.pt", "model.pt2"), "python": ("model.py",)}


def serve_repository(args: argparse.Namespace) -> int:
    """Serve a repository until interrupted (args as made by `add_arguments`)."""
    logging.basicConfig(level=getattr(args, "log_level", "info").upper())
    asyncio.run(serve(options_from_args(args)))
    return 0


def _artifact_problems(source: ModelSource) -> list[str]:
    config = source.config
    names = (config.artifact,) if config.artifact else DEFAULT_ARTIFACTS.get(config.backend, ())
    problems = []
    for version, directory in source.versions.items():
        if names and not any((directory / n).is_file() for n in names):
            problems.append(f"version {version}: missing artifact {' or '.join(names)}")
    return problems


def _resolved(source: ModelSource) -> ModelConfig:
    """The config with ONNX inputs/outputs filled in from the model file."""
    config = source.config
    if config.has_io or config.backend != "onnxruntime":
        return config
    from kiln.serving.backends.onnxruntime import OnnxRuntimeModel
    from kiln.serving.model import LoadContext

    version, directory = max(source.versions.items())
    model = OnnxRuntimeModel()
    model.load(LoadContext(config, version, directory))
    inputs, outputs = model.io_specs()
    return config.model_copy(update={"inputs": inputs, "outputs": outputs})


def validate_repository(path: str | Path) -> list[str]:
    """Every problem found, as '<model>: <message>' lines (empty = valid)."""
    try:
        names = list_models(Path(path))
    except KilnError as exc:
        return [exc.message]
    problems: list[str] = []
    configs: dict[str, ModelConfig] = {}
    for name in names:
        try:
            source = read_model(Path(path), name)
            found = _artifact_problems(source)
            problems += [f"{name}: {p}" for p in found]
            if not found:
                configs[name] = _resolved(source)
        except KilnError as exc:
            problems.append(f"{name}: {exc.message}")
    for name, config in configs.items():
        if config.backend == "ensemble":
            try:
                validate_ensemble(config, configs.get)
            except KilnError as exc:
                problems.append(f"{name}: {exc.message}")
    return problems


def main_validate(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln repo validate")
    parser.add_argument("repository")
    args = parser.parse_args(argv)
    problems = validate_repository(args.repository)
    for line in problems:
        print(line)
    if not problems:
        print(f"{args.repository}: all models valid")
    return 1 if problems else 0


def main_serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln serve")
    add_arguments(parser)
    return serve_repository(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main_validate())
