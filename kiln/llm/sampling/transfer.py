"""Host values to the sampler's device without waiting for the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory,
which makes the host wait for everything queued on the stream (the whole
forward pass). Staged through pinned memory the copy is queued like any
kernel, so a step's sampling inputs cost no host sync; on CPU it is a no-op.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
