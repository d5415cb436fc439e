"""Data planes for tests: a server's data plane over a model repository, no transports.

They allow the model control API (load/unload) unless a test says otherwise;
a server's default, --model-control none, is tested in test_model_control.py.
"""

from __future__ import annotations

from pathlib import Path

from kiln.config import ServerConfig
from kiln.dataplane.dataplane import DataPlane


def repository_plane(repository: Path, **config) -> DataPlane:
    config.setdefault("model_control", "explicit")
    return DataPlane(ServerConfig(model_repository=str(repository), **config))
