"""`kiln repo validate DIR`: every problem of a model repository, without
running user code.

It parses every config, checks versions and artifacts, reads ONNX
signatures (for configs without inputs) and checks every ensemble's graph.
"""
from __future__ import annotations

from pathlib import Path

from kiln.config import EngineConfig
from kiln.errors import KilnError
from kiln.serving.ensemble.dag import validate_ensemble
from kiln.serving.model import LoadContext
from kiln.serving.repository.config import RepositoryModelConfig, check_warmup
from kiln.serving.repository.embedding import split_embedding_settings
from kiln.serving.repository.loader import ModelSource, list_models, read_model

DEFAULT_ARTIFACTS = {"onnxruntime": ("model.onnx",), "torch": ("model.pt", "model.pt2"), "python": ("model.py",)}


def _llm_problems(config: RepositoryModelConfig) -> list[str]:
    """An `llm` model's parameters must be engine options (its model path is checked at load)."""
    if config.backend != "llm":
        return []
    try:
        _, options = split_embedding_settings({k: v for k, v in config.parameters.items() if k != "model"})
        EngineConfig.from_flat(**options)
    except KilnError as exc:
        return [f"parameters: {exc.message}"]
    return []


def _artifact_problems(source: ModelSource) -> list[str]:
    config = source.config
    names = (config.artifact,) if config.artifact else DEFAULT_ARTIFACTS.get(config.backend, ())
    problems = []
    for version, directory in source.versions.items():
        if names and not any(directory is not None and (directory / n).is_file() for n in names):
            problems.append(f"version {version}: missing artifact {' or '.join(names)}")
    return problems


def _resolved(source: ModelSource) -> RepositoryModelConfig:
    """The config with ONNX inputs/outputs filled in from the model file."""
    config = source.config
    if config.has_io or config.backend != "onnxruntime":
        return config
    # Imported here: onnxruntime is only needed for configs that omit their inputs.
    from kiln.serving.backends.onnxruntime import OnnxRuntimeModel

    version, directory = max(source.versions.items())
    model = OnnxRuntimeModel()
    model.load(LoadContext(config, version, directory))
    inputs, outputs = model.io_specs()
    # As the load fills them (version.py): a side the config declares is kept.
    resolved = config.model_copy(update={"inputs": config.inputs or inputs, "outputs": config.outputs or outputs})
    check_warmup(resolved)  # the warm-up's inputs could not be checked before the model's were known
    return resolved


def validate_repository(path: str | Path) -> list[str]:
    """Every problem found, as '<model>: <message>' lines (empty = valid)."""
    try:
        names = list_models(Path(path))
    except KilnError as exc:
        return [exc.message]
    problems: list[str] = []
    configs: dict[str, RepositoryModelConfig] = {}
    versions: dict[str, set[int]] = {}
    for name in names:
        try:
            source = read_model(Path(path), name)
            found = _artifact_problems(source) + _llm_problems(source.config)
            problems += [f"{name}: {p}" for p in found]
            if not found:
                configs[name], versions[name] = _resolved(source), set(source.versions)
        except KilnError as exc:
            problems.append(f"{name}: {exc.message}")

    def member(name: str, version: int | None) -> RepositoryModelConfig | None:
        return configs.get(name) if version is None or version in versions.get(name, ()) else None

    for name, config in configs.items():
        if config.backend == "ensemble":
            try:
                validate_ensemble(config, member)
            except KilnError as exc:
                problems.append(f"{name}: {exc.message}")
    return problems
