"""Faulting in the lazily-paged CPU KV pool while the engine is idle.

The CPU pool's pages are only taken on first write (runner/kv_pool.py), and
a first write can be slow: in a VM whose host backs guest memory on first
use, a huge page's first touch ran at ~0.46 GB/s against 11.6 GB/s for a
page the guest had used before (Zen 4 Firecracker VM, 2026-12-05), and a
fault inside a step stalls the thread that takes it while the others wait at
the next barrier. With prefix caching, freed blocks keep their hashes and go
to the tail of the free queue, so every new prompt writes never-used blocks
until the whole pool has been written once: a 32-prompt prefill ran 7-8%
slower on a fresh pool than on a faulted-in one. The engine loop calls
`step()` while it has nothing to run, one piece at a time, so the faults are
taken off the serving path; the offline LLM, which has no idle time, calls it
to the end from one thread per core when it is built (llm.py).

`MADV_POPULATE_WRITE` (Linux 5.14+) maps the pages writable as a write
would, without writing: a block in use keeps its contents, so pieces need no
coordination with the allocator. Pieces follow the allocator's order for
never-used blocks (block ids ascending): the first 2 MiB of every layer's
key and value halves, then the next 2 MiB of each, and so on.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
PIECE_BYTES = 2 << 20  # one huge page: ~4 ms to fault in at the slow rate above
PAGE_BYTES = mmap.PAGESIZE  # madvise wants a page-aligned start


def pool_pieces(pools: Sequence[torch.Tensor], piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[int, int]]:
    """(page-aligned address, length) pieces covering every pool's key and
    value halves, in block order across all of them."""
    regions = []
    for pool in pools:
        half = pool[0].numel() * pool.element_size()
        regions += [(pool.data_ptr(), half), (pool.data_ptr() + half, half)]
    longest = max((length for _, length in regions), default=0)
    for offset in range(0, longest, piece_bytes):
        for base, length in regions:
            if offset < length:
                start = base + offset
                aligned = start - start % PAGE_BYTES  # the value half need not start on a page
                yield aligned, start + min(piece_bytes, length - offset) - aligned


class KvPoolWarmer:
    """Faults in a CPU KV pool piece by piece (`step`), until it is all in."""

    def __init__(self, pools: Sequence[torch.Tensor]):
        usable = sys.platform.startswith("linux") and all(p.device.type == "cpu" for p in pools)
        self._pieces = pool_pieces([p for p in pools if p.numel()]) if usable else iter(())
        self._madvise: Callable[[int, int, int], int] | None = None
        if usable:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            madvise.restype = ctypes.c_int
            self._madvise = madvise
        self.done = not usable
        self._lock = threading.Lock()  # next() of a generator is not thread-safe

    def step(self) -> bool:
        """Fault in the next piece (the GIL is released meanwhile); False once
        nothing is left, or if the kernel cannot populate (then never again).
        Threads may call it at once: each takes its own piece."""
        madvise = self._madvise
        if self.done or madvise is None:
            return False
        with self._lock:
            piece = next(self._pieces, None)
        if piece is None:
            self.done = True
            return False
        if madvise(piece[0], piece[1], MADV_POPULATE_WRITE) != 0:
            log.debug("KV pool warming stopped: madvise(MADV_POPULATE_WRITE) errno %d", ctypes.get_errno())
            self.done = True
            return False
        return True
