"""How many bytes the paged KV pool gets.

`--kv-cache-memory-gib` sets it; unset, the pool takes
`--kv-cache-memory-fraction` of the memory available when the engine sizes
it, which is after its weights are loaded, so what the weights took is
already gone from "available". Available memory on CPU is the kernel's
MemAvailable, capped by the cgroup's limit less its usage (a container sees
its own limit, not the host's); on CUDA it is the device's free memory.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.config import MAX_KV_FRACTION, CacheConfig
from kiln.errors import ConfigError

log = logging.getLogger(__name__)

GIB = 2**30
MemoryReader = Callable[[torch.device], int | None]


def kv_pool_bytes(cache: CacheConfig, device: torch.device, available: MemoryReader | None = None) -> int:
    """The pool's byte budget: the configured GiB, else the configured fraction of available memory.
    Raises nothing: with available memory unknown, the fraction applies to 4 GiB (logged)."""
    if cache.kv_cache_memory_gib is not None:
        return int(cache.kv_cache_memory_gib * GIB)
    free = (available or available_memory_bytes)(device)
    if free is None:
        free = 4 * GIB
        log.warning("available memory unknown: the KV pool takes %.0f%% of 4 GiB (set --kv-cache-memory-gib)",
                    cache.kv_cache_memory_fraction * 100)
    budget = int(free * cache.kv_cache_memory_fraction)
    log.info("KV pool: %.0f%% of %.2f GiB available = %.2f GiB (--kv-cache-memory-fraction; "
             "--kv-cache-memory-gib sets it)", cache.kv_cache_memory_fraction * 100, free / GIB, budget / GIB)
    return budget


def check_pool_fits(pool_bytes: int, device: torch.device, available: MemoryReader | None = None) -> None:
    """A pool sized by hand (--num-blocks, --kv-cache-memory-gib) must fit the memory there is:
    a 100 GiB pool on a 23 GiB machine loaded, then faulting it in (at once, or while idle)
    got the process killed."""
    free = (available or available_memory_bytes)(device)
    if free is not None and pool_bytes > free * MAX_KV_FRACTION:
        raise ConfigError(
            f"the KV pool asked for ({pool_bytes / GIB:.2f} GiB) does not fit the {free / GIB:.2f} GiB of memory "
            f"available on {device} (at most {MAX_KV_FRACTION:.0%} of it): lower --kv-cache-memory-gib or "
            "--num-blocks, or leave both unset to size it from --kv-cache-memory-fraction",
            param="kv_cache_memory_gib",
        )


def blocks_for(budget: int, bytes_per_block: int) -> int:
    return max(1, budget // bytes_per_block)


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory this process could still take on `device`, or None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    host = meminfo_available(Path("/proc/meminfo"))
    group = cgroup_headroom(Path("/sys/fs/cgroup"))
    known = [m for m in (host, group) if m is not None]
    return min(known) if known else None


def meminfo_available(path: Path) -> int | None:
    """MemAvailable of /proc/meminfo, in bytes."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_headroom(root: Path, membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """memory.max - memory.current of this process's cgroup (v2; `membership` names it
    under `root`), or None without a limit."""
    try:
        relative = _own_cgroup(membership)
        group = root / relative.lstrip("/") if relative is not None else root
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _own_cgroup(path: Path) -> str | None:
    for line in path.read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None
