"""GPU gauges where there is no GPU: NVML (nvidia-ml-py, installed by the
test extra) finds no driver, there is no nvidia-smi, so the collector reports
nothing and /metrics carries no kiln:device_* series. Nothing is mocked: this
is the machine's own absence. tests/gpu/test_gpu_metrics.py covers presence."""
import shutil

import pytest
from prometheus_client import generate_latest

from kiln.config import ServerConfig
from kiln.dataplane.dataplane import DataPlane
from kiln.metrics.device import DeviceCollector


def _gpu_visible() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return shutil.which("nvidia-smi") is not None


pytestmark = pytest.mark.skipif(_gpu_visible(), reason="a GPU is visible here: the absence path cannot be seen")


def test_collector_is_unavailable_and_yields_nothing():
    collector = DeviceCollector("m")
    assert not collector.available
    assert list(collector.collect()) == []


def test_metrics_page_has_no_device_series():
    dataplane = DataPlane(ServerConfig())
    text = generate_latest(dataplane.registry).decode()
    assert "kiln:device_" not in text
