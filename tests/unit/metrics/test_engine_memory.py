"""kiln:model_memory_bytes: one gauge per model, version and kind an engine reports (0: left out)."""
from prometheus_client import CollectorRegistry, generate_latest

from kiln.metrics.engine_memory import EngineMemoryCollector


def test_each_reported_kind_is_a_gauge_and_zero_kinds_are_left_out():
    registry = CollectorRegistry()
    memory = {("smol", "1"): {"weights": 300, "packed": 100, "kv_cache": 2048}, ("tp", "2"): {"weights": 0}}
    registry.register(EngineMemoryCollector(lambda: memory))
    lines = [line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")]
    assert lines == [
        'kiln:model_memory_bytes{kind="kv_cache",model="smol",version="1"} 2048.0',
        'kiln:model_memory_bytes{kind="packed",model="smol",version="1"} 100.0',
        'kiln:model_memory_bytes{kind="weights",model="smol",version="1"} 300.0',
    ]
