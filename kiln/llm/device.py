"""The device an engine runs on, checked before anything is loaded onto it."""
from __future__ import annotations

import torch

from kiln.errors import ConfigError


def require_device(name: str) -> torch.device:
    """`name` as a torch.device, or a ConfigError saying why it cannot be used here."""
    try:
        device = torch.device(name)
    except RuntimeError:  # "cuda:abc", "cuda:-1"
        raise ConfigError(f"device {name!r} is not a device name (cpu, cuda or cuda:N)", param="device") from None
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(
            f"device {name!r} requested but {why} (torch {torch.__version__}); use --device cpu", param="device"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device {name!r} requested but only {count} CUDA GPU(s) are visible", param="device")
    return device
