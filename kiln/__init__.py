"""Kiln: a high-performance inference server."""
from __future__ import annotations

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
