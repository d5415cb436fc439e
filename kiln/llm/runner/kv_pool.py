"""Memory for the paged KV pool.

On CPU each layer's pool is an anonymous memory map: the kernel hands out
zeroed pages on first write, so start-up does not zero the whole pool (on a
box with `defrag=madvise` huge pages, zeroing a 1 GiB torch.zeros took
seconds, most of it page compaction) and the RSS grows with the blocks
actually written. Huge pages are still asked for (MADV_HUGEPAGE) unless
THP_MEM_ALLOC_ENABLE=0, as torch does for its own large tensors (faster
decode attention: docs/benchmarks.md (Paged attention and the KV pool dtype)).
The engine faults the pool in while it is idle (runner/kv_warm.py), so the
first writes of a burst of requests do not stall steps. On other devices the
pool is torch.zeros.
"""
from __future__ import annotations

import math
import mmap
import os

import torch


def kv_pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape` for a KV pool; on CPU backed by lazily-zeroed pages."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer holds a reference to the map: it lives as long as the tensor.
    return torch.frombuffer(pages, dtype=dtype).view(shape)
