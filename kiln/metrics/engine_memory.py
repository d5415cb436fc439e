"""Memory an LLM engine reports it holds, by kind: weights (in the serving
layout), packed (oneDNN copies of weights kept for prefill), kv_cache (the
paged pool), activations_peak (the largest step's activations at their
peak, measured once at start-up: kiln/llm/engine/activation_profile.py).

Read from what the engine reports once it is ready; a kind it does not
report (0) is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# (model, version) -> {kind: bytes}
MemorySource = Callable[[], dict[tuple[str, str], dict[str, int]]]


class EngineMemoryCollector(Collector):
    def __init__(self, source: MemorySource):
        self.source = source

    def collect(self) -> Iterator:
        family = GaugeMetricFamily(
            "kiln:model_memory_bytes",
            "Memory an LLM engine holds, by kind (weights, packed, kv_cache, activations_peak).",
            labels=["model", "version", "kind"],
        )
        for (model, version), kinds in sorted(self.source().items()):
            for kind, size in sorted(kinds.items()):
                if size > 0:
                    family.add_metric([model, version, kind], size)
        yield family
