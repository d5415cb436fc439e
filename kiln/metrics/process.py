"""CPU and memory of the server's processes (API and engine), read at scrape.

A custom collector, so the numbers are read when Prometheus asks and the
engine process (whose pid the API side learns at start) is included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# (model_name, process role) -> pid (None while unknown, e.g. an engine before it is ready)
PidSource = Callable[[], dict[tuple[str, str], int | None]]


class ProcessCollector(Collector):
    def __init__(self, pids: PidSource):
        self.pids = pids
        self._procs: dict[int, psutil.Process] = {}

    def collect(self) -> Iterator:
        cpu = CounterMetricFamily(
            "kiln:process_cpu_seconds", "CPU time used (user + system).", labels=["model_name", "process"]
        )
        rss = GaugeMetricFamily(
            "kiln:process_resident_memory_bytes", "Resident memory.", labels=["model_name", "process"]
        )
        threads = GaugeMetricFamily("kiln:process_threads", "Threads.", labels=["model_name", "process"])
        for (model_name, role), pid in self.pids().items():
            proc = self._process(pid)
            if proc is None:
                continue
            try:
                with proc.oneshot():
                    times, mem, nthreads = proc.cpu_times(), proc.memory_info(), proc.num_threads()
            except psutil.Error:
                continue
            labels = [model_name, role]
            cpu.add_metric(labels, times.user + times.system)
            rss.add_metric(labels, mem.rss)
            threads.add_metric(labels, nthreads)
        yield from (cpu, rss, threads)

    def _process(self, pid: int | None) -> psutil.Process | None:
        if pid is None:
            return None
        if pid not in self._procs:
            try:
                self._procs[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return self._procs[pid]
