"""What `kiln serve` serves: a command-line LLM, a model repository, or both,
over one data plane."""

from __future__ import annotations

from pathlib import Path

from kiln.config import EngineConfig, ServerConfig
from kiln.dataplane.dataplane import DataPlane
from kiln.llm.models.default_model import default_model_path


def default_model_name(config: EngineConfig) -> str:
    """The model file's or directory's name, without a .gguf suffix."""
    path = Path(config.model.model or default_model_path())
    return path.stem if path.suffix == ".gguf" else path.name


def build_dataplane(server: ServerConfig, llm: EngineConfig | None) -> DataPlane:
    """The data plane of a server; `llm` is the command-line model, if any."""
    dataplane = DataPlane(server)
    if llm is not None:
        dataplane.add_llm(llm, server.served_model_name or default_model_name(llm))
    dataplane.load_routes()  # after every model is known: routes are checked against them
    return dataplane
