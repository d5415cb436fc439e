"""GPU gauges where a GPU is present: read through NVML (nvidia-ml-py) or
nvidia-smi, exported in the Prometheus text."""
from prometheus_client import CollectorRegistry, generate_latest

from kiln.metrics.device import DeviceCollector


def test_device_gauges_are_exported():
    collector = DeviceCollector("m")
    assert collector.available
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    for name in ("kiln:device_memory_used_bytes", "kiln:device_memory_total_bytes", "kiln:device_utilization_perc"):
        assert f'{name}{{device="0",model_name="m"}}' in text
    total = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith('kiln:device_memory_total_bytes{device="0"'))
    assert total > 8 * 2**30
