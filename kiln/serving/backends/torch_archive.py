"""Safety check for torch.export archives (.pt2) before torch.export.load.

torch.export.load falls back to full unpickling (`weights_only=False`) for
pickled weights, custom objects and sample inputs that the safe loader
rejects. Invariant: an archive that passes `check_pt2_archive` contains no
blob that would take such a path, so loading it never runs pickled code.
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

from kiln.errors import ConfigError


def check_pt2_archive(path: Path) -> None:
    import torch

    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ConfigError(f"{path.name!r} is not a torch.export archive") from None
    with archive:
        for name in archive.namelist():
            part = name.split("/", 1)[-1]
            if part.endswith("_config.json") and part.startswith(("data/weights/", "data/constants/")):
                _check_payload_config(path, json.loads(archive.read(name)))
            elif part.startswith(("data/weights/", "data/constants/")) and part.endswith(".pt"):
                raise ConfigError(f"{path.name!r} uses the legacy pickled weight format; re-export it")
            elif part.startswith("data/sample_inputs/"):
                try:
                    torch.load(io.BytesIO(archive.read(name)), weights_only=True)
                except Exception:
                    raise ConfigError(f"{path.name!r} has sample inputs that need unsafe unpickling") from None


def _check_payload_config(path: Path, config: dict) -> None:
    for fqn, meta in config.get("config", {}).items():
        if meta.get("use_pickle"):
            raise ConfigError(f"{path.name!r}: tensor {fqn!r} is pickled; refusing to unpickle it")
        if str(meta.get("path_name", "")).startswith(("custom_obj", "opaque")):
            raise ConfigError(f"{path.name!r}: constant {fqn!r} is a pickled object; refusing it")
