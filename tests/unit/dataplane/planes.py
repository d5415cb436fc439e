"""Data planes for tests: a server's data plane over a model repository, no transports."""

from __future__ import annotations

from pathlib import Path

from kiln.config import ServerConfig
from kiln.dataplane.dataplane import DataPlane


def repository_plane(repository: Path, **config) -> DataPlane:
    return DataPlane(ServerConfig(model_repository=str(repository), **config))
