"""GPU memory and utilization gauges, read at scrape when a GPU is present.

Read through NVML (pynvml / nvidia-ml-py) or, without it, `nvidia-smi`;
never through torch.cuda, so the API process makes no CUDA context of its
own. Without either, or without a GPU, the collector reports nothing.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class DeviceSample(NamedTuple):
    gpu_index: int  # ("index" would shadow tuple.index)
    used_bytes: float
    total_bytes: float
    utilization: float  # 0-1


def _nvml_reader() -> Callable[[], list[DeviceSample]] | None:
    try:
        import pynvml  # optional dependency (nvidia-ml-py); absent on most machines

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
    except Exception:
        return None

    def read() -> list[DeviceSample]:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(DeviceSample(i, mem.used, mem.total, pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0))
        return out

    return read


def _smi_reader() -> Callable[[], list[DeviceSample]] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=index,memory.used,memory.total,utilization.gpu", "--format=csv,noheader,nounits"]

    def read() -> list[DeviceSample]:
        text = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True).stdout
        out = []
        for line in text.strip().splitlines():
            idx, used, total, util = (float(x) for x in line.split(","))
            out.append(DeviceSample(int(idx), used * 2**20, total * 2**20, util / 100.0))
        return out

    try:
        return read if read() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


class DeviceCollector(Collector):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.read = _nvml_reader() or _smi_reader()

    @property
    def available(self) -> bool:
        return self.read is not None

    def collect(self) -> Iterator:
        if self.read is None:
            return
        try:
            samples = self.read()
        except Exception as e:
            log.warning("GPU metrics unavailable: %s", e)
            return
        labels = ["model_name", "device"]
        used = GaugeMetricFamily("kiln:device_memory_used_bytes", "GPU memory in use.", labels=labels)
        total = GaugeMetricFamily("kiln:device_memory_total_bytes", "GPU memory.", labels=labels)
        util = GaugeMetricFamily("kiln:device_utilization_perc", "GPU busy fraction (0-1).", labels=labels)
        for s in samples:
            key = [self.model_name, str(s.gpu_index)]
            used.add_metric(key, s.used_bytes)
            total.add_metric(key, s.total_bytes)
            util.add_metric(key, s.utilization)
        yield from (used, total, util)
