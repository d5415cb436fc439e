"""Handing freed heap memory back to the OS after a model is loaded.

Loading frees a lot at once (the checkpoint's tensors, the float copies
that quantization or fusion replaced). glibc keeps freed memory of its heaps
for reuse, and after a large mmapped block is freed it raises its mmap
threshold (up to 32 MiB), so later tensors of that size come from the heap
too: the freed checkpoint can stay in the RSS. `malloc_trim(0)` returns
every free page of every arena to the OS.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def trim_heap() -> bool:
    """Return freed heap pages to the OS (glibc); False where there is no malloc_trim (musl, macOS)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
