"""Kiln: a high-performance inference server."""
from __future__ import annotations

import os

# Torch's CPU allocator backs tensors of 2 MiB and more with transparent huge
# pages when this is set before torch's first allocation. Decode attention
# reads the KV pool in scattered 12 KB runs (one block of one layer) across
# hundreds of MB, so 4 KiB pages cost TLB misses on every run; on the 2-vCPU box
# paged decode attention reads 8-15% faster with it (docs/benchmarks.md);
# the cost is 2-3 s more start-up.
# Set THP_MEM_ALLOC_ENABLE=0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import kiln.llm.kv_cache` etc. do not pull in torch models.
    if name == "LLM":
        from kiln.llm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kiln.llm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
